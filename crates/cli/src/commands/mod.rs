pub mod logits;
pub mod run;
