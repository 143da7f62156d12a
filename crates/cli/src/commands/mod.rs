pub mod chat;
pub mod logits;
pub mod run;
pub mod tokenize;
