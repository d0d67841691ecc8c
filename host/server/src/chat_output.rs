//! Splitting a chat answer into what OpenAI clients read apart: the model's reasoning
//! (`reasoning_content`, the text between `<think>` and `</think>`), the answer
//! (`content`) and tool calls (`tool_calls`, DeepSeek's DSML markup). Text arrives in
//! pieces as it is decoded; [`OutputSplitter::push`] gives what can be sent now and
//! holds back what may still turn out to be markup (a partial tag, the whitespace before
//! a call block, the block itself until the answer ends), so a stream's deltas add up
//! to the whole answer's parts.

use serde_json::{json, Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
/// DeepSeek V3.2 / V4's tool-call markup (its chat template's `dsml_token`).
const DSML: &str = "｜DSML｜";

/// One part of an answer, in the order the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Reasoning(String),
    Content(String),
    ToolCalls(Vec<ToolCall>),
}

/// A parsed tool call: the function's name and its arguments as a JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    /// OpenAI's shape: `arguments` as a JSON string; `id` names the call for the
    /// `tool` message that answers it.
    pub fn to_openai(&self, id: &str) -> Value {
        json!({
            "id": id,
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": Value::Object(self.arguments.clone()).to_string(),
            }
        })
    }
}

/// What the splitter looks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct SplitOptions {
    /// Reasoning is split out at all (`--reasoning-format deepseek`).
    pub reasoning: bool,
    /// The prompt ended inside a thinking block (the template's generation prompt
    /// opened `<think>`): the answer starts as reasoning.
    pub starts_in_reasoning: bool,
    /// Tool calls in DSML markup are parsed (the request gave tools).
    pub dsml_tools: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Nothing sent yet: a leading `<think>` may still open reasoning.
    Start,
    Reasoning,
    Content,
    /// Inside a tool-call block: held until the end.
    Tools,
}

/// Incremental splitter of one answer.
#[derive(Debug)]
pub struct OutputSplitter {
    opts: SplitOptions,
    state: State,
    /// Text not yet given out.
    held: String,
    /// Strip the whitespace that follows `</think>` before the answer.
    trim_start: bool,
    /// The whitespace between the answer and a tool-call block (given back with the
    /// block if it does not parse).
    gap: String,
}

/// The length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl OutputSplitter {
    pub fn new(opts: SplitOptions) -> Self {
        let state = match (opts.reasoning, opts.starts_in_reasoning) {
            (true, true) => State::Reasoning,
            (true, false) => State::Start,
            (false, _) => State::Content,
        };
        Self {
            opts,
            state,
            held: String::new(),
            trim_start: false,
            gap: String::new(),
        }
    }

    /// Adds decoded text; returns the parts that are now certain.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(r) = t.strip_prefix(THINK_OPEN) {
                        self.held = r.to_string();
                        self.state = State::Reasoning;
                    } else if THINK_OPEN.starts_with(t) {
                        return out; // (maybe the start of `<think>`)
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    if let Some(i) = self.held.find(THINK_CLOSE) {
                        let r: String = self.held.drain(..i + THINK_CLOSE.len()).collect();
                        push_text(&mut out, Part::Reasoning(r[..i].to_string()));
                        self.state = State::Content;
                        self.trim_start = true;
                    } else {
                        let keep = partial_suffix(&self.held, THINK_CLOSE);
                        let r: String = self.held.drain(..self.held.len() - keep).collect();
                        push_text(&mut out, Part::Reasoning(r));
                        return out;
                    }
                }
                State::Content => {
                    if self.trim_start {
                        let t = self.held.trim_start().len();
                        self.held.drain(..self.held.len() - t);
                        if self.held.is_empty() {
                            return out;
                        }
                        self.trim_start = false;
                    }
                    if !self.opts.dsml_tools {
                        let c = std::mem::take(&mut self.held);
                        push_text(&mut out, Part::Content(c));
                        return out;
                    }
                    let found = OPENS.iter().filter_map(|o| self.held.find(o)).min();
                    if let Some(i) = found {
                        let c: String = self.held.drain(..i).collect();
                        let answer = c.trim_end();
                        self.gap = c[answer.len()..].to_string();
                        push_text(&mut out, Part::Content(answer.to_string()));
                        self.state = State::Tools;
                        return out;
                    }
                    // Hold a possible start of the tag, and the whitespace before it
                    // (the template puts a blank line between the answer and a call).
                    let keep = OPENS
                        .iter()
                        .map(|o| partial_suffix(&self.held, o))
                        .max()
                        .unwrap_or(0);
                    let body = &self.held[..self.held.len() - keep];
                    let cut = body.trim_end().len();
                    let c: String = self.held.drain(..cut).collect();
                    push_text(&mut out, Part::Content(c));
                    return out;
                }
                State::Tools => return out,
            }
        }
    }

    /// The end of the answer: what was held, and the tool calls. A tool-call block that
    /// does not parse (cut by the length limit, malformed) comes back as content:
    /// nothing the model wrote is dropped.
    pub fn finish(&mut self) -> Vec<Part> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Reasoning => push_text(&mut out, Part::Reasoning(held)),
            State::Start | State::Content => push_text(&mut out, Part::Content(held)),
            State::Tools => match parse_dsml_calls(&held) {
                Some((calls, rest)) => {
                    out.push(Part::ToolCalls(calls));
                    push_text(&mut out, Part::Content(rest.trim().to_string()));
                }
                None => push_text(
                    &mut out,
                    Part::Content(std::mem::take(&mut self.gap) + &held),
                ),
            },
        }
        out
    }

    /// A whole answer's parts (not streamed): `push` of all of it, then `finish`.
    pub fn split(opts: SplitOptions, text: &str) -> Vec<Part> {
        let mut s = Self::new(opts);
        let mut parts = s.push(text);
        parts.extend(s.finish());
        parts
    }
}

/// Adds a text part unless it is empty.
fn push_text(out: &mut Vec<Part>, p: Part) {
    match &p {
        Part::Reasoning(s) | Part::Content(s) if s.is_empty() => {}
        _ => out.push(p),
    }
}

/// The names of a DSML call block: DeepSeek V4's, then V3.2's.
const BLOCKS: [&str; 2] = ["tool_calls", "function_calls"];
/// Their opening tags (`<` DSML name `>`), looked for after every decoded piece.
const OPENS: [&str; 2] = ["<｜DSML｜tool_calls>", "<｜DSML｜function_calls>"];

/// The calls of a DSML block (`<DSML tool_calls>` or `function_calls`, one `invoke
/// name="f"` per call, its `parameter name="k" string="true|false"` values: strings as
/// written, others JSON), and the text after the block. None if it is not a whole,
/// well-formed block.
pub fn parse_dsml_calls(s: &str) -> Option<(Vec<ToolCall>, &str)> {
    let s = s.trim_start();
    let block = BLOCKS
        .into_iter()
        .find(|b| s.starts_with(&format!("<{DSML}{b}>")))?;
    let open = format!("<{DSML}{block}>");
    let close = format!("</{DSML}{block}>");
    let inv_open = format!("<{DSML}invoke name=\"");
    let inv_close = format!("</{DSML}invoke>");
    let par_open = format!("<{DSML}parameter name=\"");
    let par_close = format!("</{DSML}parameter>");
    let mut rest = s.strip_prefix(open.as_str())?;
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(close.as_str()) {
            return (!calls.is_empty()).then_some((calls, after));
        }
        let r = rest.strip_prefix(inv_open.as_str())?;
        let (name, r) = r.split_once("\">")?;
        let (body, after) = r.split_once(inv_close.as_str())?;
        let mut arguments = Map::new();
        let mut b = body.trim_start();
        while !b.is_empty() {
            let r = b.strip_prefix(par_open.as_str())?;
            let (key, r) = r.split_once('"')?;
            let r = r.trim_start().strip_prefix("string=\"")?;
            let (is_str, r) = r.split_once("\">")?;
            let (val, r) = r.split_once(par_close.as_str())?;
            let v = match is_str {
                "true" => Value::String(val.to_string()),
                // (a value that is not JSON after all stays the text it is)
                _ => serde_json::from_str(val).unwrap_or_else(|_| Value::String(val.into())),
            };
            arguments.insert(key.to_string(), v);
            b = r.trim_start();
        }
        if name.is_empty() {
            return None;
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments,
        });
        rest = after;
    }
}

/// Whether a chat template writes tool calls in DSML (DeepSeek V3.2 / V4).
pub fn template_has_dsml_tools(source: &str) -> bool {
    source.contains("DSML") && BLOCKS.iter().any(|b| source.contains(b))
}

/// Whether a rendered prompt leaves the model inside a thinking block.
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(tag: &str) -> String {
        tag.replace("|D|", DSML)
    }

    const CALLS: &str = "<|D|tool_calls>\n<|D|invoke name=\"get_weather\">\n<|D|parameter name=\"city\" string=\"true\">Paris, \"FR\"</|D|parameter>\n<|D|parameter name=\"days\" string=\"false\">3</|D|parameter>\n<|D|parameter name=\"opts\" string=\"false\">{\"unit\": \"C\", \"hourly\": [1, 2]}</|D|parameter>\n</|D|invoke>\n<|D|invoke name=\"now\">\n\n</|D|invoke>\n</|D|tool_calls>";

    fn whole(opts: SplitOptions, text: &str) -> Vec<Part> {
        join(OutputSplitter::split(opts, text))
    }

    /// Neighbouring parts of a kind joined (as a client joins a stream's deltas).
    fn join(v: Vec<Part>) -> Vec<Part> {
        let mut joined: Vec<Part> = Vec::new();
        for p in v {
            match (joined.last_mut(), p) {
                (Some(Part::Reasoning(a)), Part::Reasoning(b)) => a.push_str(&b),
                (Some(Part::Content(a)), Part::Content(b)) => a.push_str(&b),
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    /// Parts of a stream fed one char at a time, neighbours of a kind joined.
    fn streamed(opts: SplitOptions, text: &str) -> Vec<Part> {
        let mut s = OutputSplitter::new(opts);
        let mut v = Vec::new();
        for c in text.chars() {
            v.extend(s.push(&c.to_string()));
        }
        v.extend(s.finish());
        join(v)
    }

    fn all() -> SplitOptions {
        SplitOptions {
            reasoning: true,
            starts_in_reasoning: false,
            dsml_tools: true,
        }
    }

    #[test]
    fn parses_calls_with_typed_arguments() {
        let block = d(CALLS);
        let (calls, rest) = parse_dsml_calls(&block).unwrap();
        assert_eq!(rest, "");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            Value::Object(calls[0].arguments.clone()),
            json!({"city": "Paris, \"FR\"", "days": 3, "opts": {"unit": "C", "hourly": [1, 2]}})
        );
        assert_eq!(
            (calls[1].name.as_str(), calls[1].arguments.len()),
            ("now", 0)
        );
        let o = calls[0].to_openai("call_1");
        let args: Value =
            serde_json::from_str(o["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args["days"], 3);
    }

    #[test]
    fn v3_2_function_calls_blocks_parse_too() {
        assert_eq!(OPENS, BLOCKS.map(|b| format!("<{DSML}{b}>")));
        let block = d(CALLS).replace("tool_calls>", "function_calls>");
        let text = format!("Ok.\n\n{block}");
        let want = vec![
            Part::Content("Ok.".into()),
            Part::ToolCalls(parse_dsml_calls(&d(CALLS)).unwrap().0),
        ];
        assert_eq!(streamed(all(), &text), want);
        assert_eq!(whole(all(), &text), want);
        // a block opened as one kind and closed as the other is not a block
        let mixed = d(CALLS).replacen("tool_calls>", "function_calls>", 1);
        assert!(parse_dsml_calls(&mixed).is_none());
    }

    #[test]
    fn malformed_blocks_do_not_parse() {
        let c = d(CALLS);
        // cut anywhere: no whole block
        for cut in (0..c.len()).filter(|&i| c.is_char_boundary(i)) {
            assert!(parse_dsml_calls(&c[..cut]).is_none(), "cut at {cut}");
        }
        assert!(parse_dsml_calls(&d("<|D|tool_calls>\n</|D|tool_calls>")).is_none());
        assert!(parse_dsml_calls(&d(
            "<|D|tool_calls><|D|invoke name=\"f\"><|D|parameter name=\"a\">1</|D|parameter></|D|invoke></|D|tool_calls>"
        ))
        .is_none());
    }

    #[test]
    fn splits_reasoning_content_and_calls_whole_and_streamed() {
        let text = format!(
            "<think>Let me check.</think>\n\nI will look it up.\n\n{}",
            d(CALLS)
        );
        let want = vec![
            Part::Reasoning("Let me check.".into()),
            Part::Content("I will look it up.".into()),
            Part::ToolCalls(parse_dsml_calls(&d(CALLS)).unwrap().0),
        ];
        assert_eq!(whole(all(), &text), want);
        assert_eq!(streamed(all(), &text), want);
        // The prompt opened the thinking block: no `<think>` in the answer.
        let o = SplitOptions {
            starts_in_reasoning: true,
            ..all()
        };
        assert_eq!(streamed(o, &text["<think>".len()..]), want);
    }

    #[test]
    fn plain_answers_pass_through() {
        for text in [
            "Hello <thin",
            "a < b and c <| d",
            "<thinking> is a word",
            "  spaced  ",
        ] {
            let want = vec![Part::Content(text.into())];
            assert_eq!(whole(all(), text), want, "{text:?}");
            assert_eq!(streamed(all(), text), want, "{text:?}");
        }
        // With reasoning off, `<think>` is content; without tools, so is DSML.
        let off = SplitOptions::default();
        let t = format!("<think>x</think>{}", d(CALLS));
        assert_eq!(whole(off, &t), vec![Part::Content(t.clone())]);
        let no_tools = SplitOptions {
            dsml_tools: false,
            ..all()
        };
        assert_eq!(
            streamed(no_tools, &t),
            vec![Part::Reasoning("x".into()), Part::Content(d(CALLS))]
        );
    }

    #[test]
    fn unfinished_parts_are_kept() {
        // Cut inside reasoning (the length limit): all of it is reasoning.
        assert_eq!(
            streamed(all(), "<think>still thinking </thi"),
            vec![Part::Reasoning("still thinking </thi".into())]
        );
        // A cut tool-call block comes back as content.
        let c = d(CALLS);
        let cut = &c[..c.len() / 2];
        let t = format!("Sure.\n\n{cut}");
        assert_eq!(streamed(all(), &t), vec![Part::Content(t.clone())]);
        assert_eq!(whole(all(), &t), vec![Part::Content(t.clone())]);
    }

    #[test]
    fn detects_templates_and_thinking_prompts() {
        assert!(template_has_dsml_tools(
            "{%- set dsml_token = '｜DSML｜' -%}{{ '<' + dsml_token + 'tool_calls>' }}"
        ));
        assert!(!template_has_dsml_tools("{{ '<tool_call>' }}"));
        assert!(prompt_opens_thinking("<｜Assistant｜><think>"));
        assert!(prompt_opens_thinking("<｜Assistant｜><think>\n"));
        assert!(!prompt_opens_thinking("<｜Assistant｜></think>"));
    }
}
