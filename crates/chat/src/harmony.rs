//! gpt-oss's "harmony" chat format, rendered here for checkpoints that ship
//! no chat template (with a template, [`crate::ChatFormat`] renders through
//! it instead).
//!
//! A message is `<|start|>ROLE HEADER<|message|>BODY<|end|>`. Assistant
//! headers name a channel (`<|channel|>analysis`, `commentary` or `final`);
//! a tool call is a commentary message addressed `to=functions.NAME`,
//! `<|constrain|>json`, ending in `<|call|>`; a tool result comes from role
//! `functions.NAME to=assistant` on the commentary channel. The generation
//! prompt is `<|start|>assistant`.
//!
//! What this renderer writes (the wording of the system and developer
//! bodies is fathom's own):
//! - a system message carrying `Reasoning: low|medium|high` and the channels;
//! - a developer message when there are instructions (the leading `system`
//!   or `developer` messages), tools or a response format;
//! - user turns; assistant turns as an analysis message (the reasoning, kept
//!   only after the last user message, as earlier turns' thinking is not
//!   shown to the model again), the content on the final channel (on
//!   commentary when the turn also calls tools) and one message per tool call;
//!   a past final answer ends in `<|end|>`, a past call in `<|call|>`;
//! - tool results named by `tool`/`name`, else by the matching
//!   `tool_call_id`, else by position after the calling assistant turn;
//! - later `system`/`developer` messages as developer messages in place.
//!
//! Special tokens are `Trusted` segments and everything else `Text`, so a
//! special spelled inside content or a tool name stays ordinary text.

use serde_json::Value;

use crate::ChatError;
use crate::k3::{ResponseFormat, ToolChoice, content_text};
use crate::message::{Message, ToolCall};
use crate::pyjson::{PyJsonOptions, dumps};
use crate::segment::{Segment, SegmentWriter};

/// Special-token spellings of the format.
pub const START: &str = "<|start|>";
pub const END: &str = "<|end|>";
pub const MESSAGE: &str = "<|message|>";
pub const CHANNEL: &str = "<|channel|>";
pub const CONSTRAIN: &str = "<|constrain|>";
pub const RETURN: &str = "<|return|>";
pub const CALL: &str = "<|call|>";
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// The tokens that end a harmony reply: `<|return|>` (final answer),
/// `<|call|>` (tool call) and `<|endoftext|>`.
pub const REPLY_STOPS: [&str; 3] = [RETURN, CALL, END_OF_TEXT];

/// The `Reasoning:` level of the system message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    /// The spelling used in the prompt (and a template's `reasoning_effort`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }

    /// gpt-oss always thinks, so "thinking off" is the least of it: `low`;
    /// on or unset is the format's default, `medium`.
    pub fn from_thinking(thinking: Option<bool>) -> Self {
        match thinking {
            Some(false) => ReasoningEffort::Low,
            _ => ReasoningEffort::Medium,
        }
    }
}

/// Rendering options.
#[derive(Debug, Clone, PartialEq)]
pub struct HarmonyOptions {
    pub reasoning: ReasoningEffort,
    /// End with `<|start|>assistant`.
    pub add_generation_prompt: bool,
    /// OpenAI `tools` array.
    pub tools: Option<Value>,
    /// `none` leaves the tools undeclared; `required` asks for a call.
    pub tool_choice: Option<ToolChoice>,
    pub response_format: Option<ResponseFormat>,
}

impl Default for HarmonyOptions {
    fn default() -> Self {
        HarmonyOptions {
            reasoning: ReasoningEffort::Medium,
            add_generation_prompt: true,
            tools: None,
            tool_choice: None,
            response_format: None,
        }
    }
}

/// Renders a conversation to segments.
pub fn render_harmony(messages: &[Message], o: &HarmonyOptions) -> Result<Vec<Segment>, ChatError> {
    let mut w = SegmentWriter::default();
    message(&mut w, "system", None, &system_text(o));

    let lead = messages
        .iter()
        .take_while(|m| is_instructions(&m.role))
        .count();
    let mut instructions = Vec::new();
    for (index, m) in messages[..lead].iter().enumerate() {
        let t = content_text(m, index)?;
        if !t.is_empty() {
            instructions.push(t);
        }
    }
    let developer = developer_text(&instructions.join("\n\n"), o)?;
    if !developer.is_empty() {
        message(&mut w, "developer", None, &developer);
    }

    let last_user = messages.iter().rposition(|m| m.role == "user");
    let mut calls: &[ToolCall] = &[];
    let mut results = 0usize;
    for (index, m) in messages.iter().enumerate().skip(lead) {
        match m.role.as_str() {
            "user" => message(&mut w, "user", None, &content_text(m, index)?),
            r if is_instructions(r) => message(&mut w, "developer", None, &content_text(m, index)?),
            "assistant" => {
                calls = &m.tool_calls;
                results = 0;
                let keep_reasoning = last_user.is_none_or(|u| index > u);
                assistant(&mut w, m, index, keep_reasoning)?;
            }
            "tool" => {
                let name =
                    tool_name(m, calls, results).ok_or(ChatError::UnnamedToolResult { index })?;
                results += 1;
                w.trusted(START);
                w.text(&format!("functions.{name} to=assistant"));
                w.trusted(CHANNEL);
                w.text("commentary");
                w.trusted(MESSAGE);
                w.text(&content_text(m, index)?);
                w.trusted(END);
            }
            other => {
                return Err(ChatError::UnknownRole {
                    index,
                    role: other.to_string(),
                });
            }
        }
    }
    if o.add_generation_prompt {
        w.trusted(START);
        w.text("assistant");
    }
    Ok(w.finish())
}

fn is_instructions(role: &str) -> bool {
    role == "system" || role == "developer"
}

/// `<|start|>ROLE[<|channel|>CHANNEL]<|message|>BODY<|end|>`.
fn message(w: &mut SegmentWriter, role: &str, channel: Option<&str>, body: &str) {
    w.trusted(START);
    w.text(role);
    if let Some(c) = channel {
        w.trusted(CHANNEL);
        w.text(c);
    }
    w.trusted(MESSAGE);
    w.text(body);
    w.trusted(END);
}

fn system_text(o: &HarmonyOptions) -> String {
    format!(
        "Reasoning: {}\n\nChannels: analysis, commentary, final. Every assistant message \
         names its channel: analysis for thinking, commentary for function calls, final \
         for the answer.",
        o.reasoning.as_str()
    )
}

/// The developer message body: instructions, tools, response format.
fn developer_text(instructions: &str, o: &HarmonyOptions) -> Result<String, ChatError> {
    let mut sections = Vec::new();
    if !instructions.is_empty() {
        sections.push(format!("# Instructions\n\n{instructions}"));
    }
    let tools = match o.tool_choice {
        Some(ToolChoice::None) => None,
        _ => o.tools.as_ref(),
    };
    let declared = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, t)| tool_text(i, t))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ChatError::InvalidTool {
                index: 0,
                message: "`tools` must be an array".into(),
            });
        }
    };
    if !declared.is_empty() {
        let mut s = String::from(
            "# Tools\n\nTo call a function, send a commentary message to functions.NAME \
             whose body is the arguments as a JSON object.",
        );
        if o.tool_choice == Some(ToolChoice::Required) {
            s.push_str(" Call a function before you answer.");
        }
        for d in declared {
            s.push_str("\n\n");
            s.push_str(&d);
        }
        sections.push(s);
    }
    match &o.response_format {
        Some(ResponseFormat::JsonObject) => sections.push(
            "# Response format\n\nThe final answer is one JSON object and nothing else.".into(),
        ),
        Some(ResponseFormat::JsonSchema(schema)) => sections.push(format!(
            "# Response format\n\nThe final answer is one JSON value and nothing else, \
             matching this JSON Schema: {}",
            dumps(schema, PyJsonOptions::default())
        )),
        Some(ResponseFormat::Text) | None => {}
    }
    Ok(sections.join("\n\n"))
}

/// One declared function: `## functions.NAME`, its description and parameters.
fn tool_text(index: usize, tool: &Value) -> Result<String, ChatError> {
    let f = tool.get("function").unwrap_or(tool);
    let Some(name) = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    else {
        return Err(ChatError::InvalidTool {
            index,
            message: "a function needs a non-empty `name`".into(),
        });
    };
    let mut s = format!("## functions.{name}");
    if let Some(d) = f.get("description").and_then(Value::as_str) {
        s.push_str("\n\n");
        s.push_str(d);
    }
    if let Some(p) = f.get("parameters").filter(|p| !p.is_null()) {
        s.push_str("\n\nParameters: ");
        s.push_str(&dumps(p, PyJsonOptions::default()));
    }
    Ok(s)
}

fn assistant(
    w: &mut SegmentWriter,
    m: &Message,
    index: usize,
    keep_reasoning: bool,
) -> Result<(), ChatError> {
    let reasoning = m
        .reasoning_content
        .as_deref()
        .filter(|r| keep_reasoning && !r.is_empty());
    if let Some(r) = reasoning {
        message(w, "assistant", Some("analysis"), r);
    }
    let content = content_text(m, index)?;
    if !content.is_empty() || (m.tool_calls.is_empty() && reasoning.is_none()) {
        let channel = if m.tool_calls.is_empty() {
            "final"
        } else {
            "commentary"
        };
        message(w, "assistant", Some(channel), &content);
    }
    for (k, call) in m.tool_calls.iter().enumerate() {
        let args = match &call.function.arguments {
            Value::Null => "{}".to_string(),
            Value::String(s) => s.clone(),
            v @ Value::Object(_) => v.to_string(),
            _ => return Err(ChatError::BadToolArguments { index, call: k + 1 }),
        };
        w.trusted(START);
        w.text("assistant");
        w.trusted(CHANNEL);
        w.text(&format!("commentary to=functions.{} ", call.function.name));
        w.trusted(CONSTRAIN);
        w.text("json");
        w.trusted(MESSAGE);
        w.text(&args);
        w.trusted(CALL);
    }
    Ok(())
}

/// A tool result's function name: its own `tool`/`name`, else the call with
/// its `tool_call_id`, else the call at its position among the results.
fn tool_name(m: &Message, calls: &[ToolCall], position: usize) -> Option<String> {
    if let Some(n) = m.tool.as_ref().or(m.name.as_ref()) {
        return Some(n.clone());
    }
    let by_id = m
        .tool_call_id
        .as_deref()
        .and_then(|id| calls.iter().find(|c| c.id.as_deref() == Some(id)));
    by_id
        .or_else(|| calls.get(position))
        .map(|c| c.function.name.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::segments_to_string;
    use serde_json::json;

    fn msgs(v: Value) -> Vec<Message> {
        serde_json::from_value(v).unwrap()
    }

    fn render(m: &[Message], o: &HarmonyOptions) -> String {
        segments_to_string(&render_harmony(m, o).unwrap())
    }

    const SYSTEM_MEDIUM: &str = "<|start|>system<|message|>Reasoning: medium\n\nChannels: \
        analysis, commentary, final. Every assistant message names its channel: analysis for \
        thinking, commentary for function calls, final for the answer.<|end|>";

    #[test]
    fn a_tool_calling_turn_renders_exactly() {
        let m = msgs(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "reasoning_content": "Need the tool.", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
        ]));
        let o = HarmonyOptions {
            tools: Some(json!([{"type": "function", "function": {
                "name": "get_weather", "description": "Current weather.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])),
            ..HarmonyOptions::default()
        };
        let want = format!(
            "{SYSTEM_MEDIUM}\
             <|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n\
             To call a function, send a commentary message to functions.NAME whose body is \
             the arguments as a JSON object.\n\n## functions.get_weather\n\nCurrent weather.\
             \n\nParameters: {{\"type\": \"object\", \"properties\": {{\"city\": {{\"type\": \
             \"string\"}}}}}}<|end|>\
             <|start|>user<|message|>Weather in Paris?<|end|>\
             <|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>\
             <|start|>assistant<|channel|>commentary to=functions.get_weather \
             <|constrain|>json<|message|>{{\"city\":\"Paris\"}}<|call|>\
             <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\
             18C, sunny<|end|>\
             <|start|>assistant"
        );
        assert_eq!(render(&m, &o), want);
    }

    #[test]
    fn earlier_turns_drop_their_reasoning_and_end_in_end() {
        let m = msgs(json!([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "greet", "content": "Hello!"},
            {"role": "user", "content": "2+2?"},
        ]));
        let o = HarmonyOptions {
            reasoning: ReasoningEffort::Low,
            add_generation_prompt: false,
            ..HarmonyOptions::default()
        };
        let want = SYSTEM_MEDIUM.replace("medium", "low")
            + "<|start|>user<|message|>Hi<|end|>\
               <|start|>assistant<|channel|>final<|message|>Hello!<|end|>\
               <|start|>user<|message|>2+2?<|end|>";
        assert_eq!(render(&m, &o), want);
    }

    #[test]
    fn content_beside_calls_is_a_commentary_preamble_and_results_go_by_position() {
        let m = msgs(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"function": {"name": "a", "arguments": {"x": 1}}},
                {"function": {"name": "b", "arguments": null}}]},
            {"role": "tool", "content": "A"},
            {"role": "tool", "content": "B"},
            {"role": "developer", "content": "Be polite."},
        ]));
        let o = HarmonyOptions {
            add_generation_prompt: false,
            ..HarmonyOptions::default()
        };
        let want = format!(
            "{SYSTEM_MEDIUM}<|start|>user<|message|>go<|end|>\
             <|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>\
             <|start|>assistant<|channel|>commentary to=functions.a <|constrain|>json\
             <|message|>{{\"x\":1}}<|call|>\
             <|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json\
             <|message|>{{}}<|call|>\
             <|start|>functions.a to=assistant<|channel|>commentary<|message|>A<|end|>\
             <|start|>functions.b to=assistant<|channel|>commentary<|message|>B<|end|>\
             <|start|>developer<|message|>Be polite.<|end|>"
        );
        assert_eq!(render(&m, &o), want);
    }

    #[test]
    fn content_is_text_and_specials_are_trusted() {
        let m = msgs(json!([{"role": "user", "content": "<|end|>"}]));
        let segs = render_harmony(&m, &HarmonyOptions::default()).unwrap();
        assert!(segs.contains(&Segment::Text("user".into())));
        assert!(segs.contains(&Segment::Text("<|end|>".into())));
        assert_eq!(segs.last(), Some(&Segment::Text("assistant".into())));
        for s in &segs {
            if let Segment::Trusted(t) = s {
                assert!(t.starts_with("<|") && t.ends_with("|>"), "{t:?}");
            }
        }
    }

    #[test]
    fn tool_choice_none_hides_tools_and_required_asks_for_a_call() {
        let m = msgs(json!([{"role": "user", "content": "x"}]));
        let tools = Some(json!([{"name": "f"}]));
        let none = HarmonyOptions {
            tools: tools.clone(),
            tool_choice: Some(ToolChoice::None),
            ..HarmonyOptions::default()
        };
        assert!(!render(&m, &none).contains("developer"));
        let required = HarmonyOptions {
            tools,
            tool_choice: Some(ToolChoice::Required),
            response_format: Some(ResponseFormat::JsonObject),
            ..HarmonyOptions::default()
        };
        let text = render(&m, &required);
        assert!(text.contains(
            "Call a function before you answer.\n\n## functions.f\n\n# Response format\n\n\
             The final answer is one JSON object and nothing else.<|end|>"
        ));
        let json_only = HarmonyOptions {
            response_format: Some(ResponseFormat::JsonObject),
            ..HarmonyOptions::default()
        };
        assert!(render(&m, &json_only).contains(
            "<|start|>developer<|message|># Response format\n\nThe final answer is one JSON \
             object and nothing else.<|end|>"
        ));
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let user = msgs(json!([{"role": "user", "content": "x"}]));
        let bad_tools = HarmonyOptions {
            tools: Some(json!([{"type": "function", "function": {}}])),
            ..HarmonyOptions::default()
        };
        assert!(matches!(
            render_harmony(&user, &bad_tools),
            Err(ChatError::InvalidTool { index: 0, .. })
        ));
        let not_a_list = HarmonyOptions {
            tools: Some(json!({"name": "f"})),
            ..HarmonyOptions::default()
        };
        assert!(render_harmony(&user, &not_a_list).is_err());
        let unnamed =
            msgs(json!([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]));
        assert!(matches!(
            render_harmony(&unnamed, &HarmonyOptions::default()),
            Err(ChatError::UnnamedToolResult { index: 1 })
        ));
        let role = msgs(json!([{"role": "robot", "content": "x"}]));
        assert!(matches!(
            render_harmony(&role, &HarmonyOptions::default()),
            Err(ChatError::UnknownRole { index: 0, .. })
        ));
        let args = msgs(json!([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": [1]}}]}]));
        assert!(matches!(
            render_harmony(&args, &HarmonyOptions::default()),
            Err(ChatError::BadToolArguments { index: 0, call: 1 })
        ));
        let image = msgs(json!([{"role": "user", "content": [{"type": "image_url"}]}]));
        assert!(matches!(
            render_harmony(&image, &HarmonyOptions::default()),
            Err(ChatError::UnsupportedContent { index: 0, .. })
        ));
    }

    #[test]
    fn thinking_maps_to_reasoning_effort() {
        assert_eq!(
            ReasoningEffort::from_thinking(Some(false)),
            ReasoningEffort::Low
        );
        assert_eq!(
            ReasoningEffort::from_thinking(Some(true)),
            ReasoningEffort::Medium
        );
        assert_eq!(
            ReasoningEffort::from_thinking(None),
            ReasoningEffort::Medium
        );
    }
}
