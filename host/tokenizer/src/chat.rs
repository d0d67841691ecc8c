//! Chat templates (Jinja, as shipped in `tokenizer.chat_template`), rendered with
//! minijinja set up the way HF transformers sets up jinja2 for chat templates:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python string/dict methods
//! (`.strip()`, `.startswith()`, `.items()` ...), `raise_exception(msg)`,
//! `strftime_now(fmt)`, and a `tojson` that writes JSON the way Python's
//! `json.dumps(..., ensure_ascii=False)` does.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::{ChatMessage, TokenizerError};

/// ChatML, used when a model ships no template of its own (the caller logs that
/// it fell back).
pub const FALLBACK_CHAT_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    pub(crate) fn compile(source: &str) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(template_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("from_json", from_json);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(template_error)?;
        Ok(Self { env })
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        (add_generation_prompt, vars): (bool, &crate::TemplateVars),
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, TokenizerError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut pairs = vec![
                    ("role".to_string(), Value::from(m.role.as_str())),
                    ("content".to_string(), Value::from(m.content.as_str())),
                ];
                for (k, v) in &m.extra {
                    pairs.push((k.clone(), json_value(v)));
                }
                Value::from_pairs(pairs)
            })
            .collect();
        // (the request's variables first: the fixed ones win)
        let mut pairs: Vec<(String, Value)> = vars
            .iter()
            .map(|(k, v)| (k.clone(), json_value(v)))
            .collect();
        pairs.extend([
            ("messages".to_string(), Value::from(messages)),
            (
                "add_generation_prompt".to_string(),
                Value::from(add_generation_prompt),
            ),
            ("bos_token".to_string(), Value::from(bos_token)),
            ("eos_token".to_string(), Value::from(eos_token)),
        ]);
        let ctx = Value::from_pairs(pairs);
        self.env
            .get_template(TEMPLATE_NAME)
            .and_then(|t| t.render(ctx))
            .map_err(template_error)
    }
}

fn template_error(e: Error) -> TokenizerError {
    let mut message = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let _ = write!(message, "; caused by: {s}");
        source = s.source();
    }
    TokenizerError::Template {
        line: e.line(),
        message,
    }
}

/// A JSON value as a template value (objects keep their key order).
pub(crate) fn json_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::from(s.as_str()),
        J::Array(a) => Value::from(a.iter().map(json_value).collect::<Vec<_>>()),
        J::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.clone(), json_value(v)))),
    }
}

/// `s | from_json`: a JSON string as a value (templates that take tool-call
/// arguments as the string OpenAI sends).
fn from_json(s: String) -> Result<Value, Error> {
    serde_json::from_str::<serde_json::Value>(&s)
        .map(|v| json_value(&v))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("from_json: {e}")))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("template raised: {message}"),
    ))
}

/// `strftime_now("%d %b %Y")`: the current UTC time, for templates that print a date.
fn strftime_now(format: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Proleptic Gregorian (year, month 1-12, day 1-31) of a count of days since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Work in 400-year eras that start on 0000-03-01, so the leap day ends a year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153; // 0 = March
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:2}"),
            Some('-') => match chars.next() {
                Some('d') => write!(out, "{day}"),
                Some('m') => write!(out, "{month}"),
                Some(o) => write!(out, "%-{o}"),
                None => write!(out, "%-"),
            },
            Some('B') => write!(out, "{month_name}"),
            Some('b') | Some('h') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('H') => write!(out, "{hour:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('%') => write!(out, "%"),
            Some(o) => write!(out, "%{o}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// `x | tojson(indent=None)`, written like Python's `json.dumps(x, ensure_ascii=False)`:
/// `", "` / `": "` separators without indent, `","` / `": "` with it.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("sort_keys")?; // accepted, keys keep insertion order
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = value.as_i64().filter(|_| value.is_integer()) {
                let _ = write!(out, "{i}");
            } else if let Ok(f) = f64::try_from(value.clone()) {
                if !f.is_finite() {
                    out.push_str(if f.is_nan() {
                        "NaN"
                    } else if f > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    });
                } else if f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else {
                    let _ = write!(out, "{f}");
                }
            } else {
                let _ = write!(out, "{value}");
            }
        }
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(s) => write_json_str(out, s),
                    None => write_json_str(out, &key.to_string()),
                }
                out.push_str(": ");
                write_json(out, &value.get_item(key)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => write_json_str(out, &value.to_string()),
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", 0), "1970-01-01 00:00:00");
        // 2024-02-29 12:34:56 UTC, a Thursday.
        assert_eq!(
            strftime_utc("%d %b %Y %A %B %y %-d%%", 1_709_210_096),
            "29 Feb 2024 Thursday February 24 29%"
        );
        assert_eq!(strftime_utc("%Y-%m-%d", 951_782_400), "2000-02-29");
        assert_eq!(strftime_utc("%Y-%m-%d", -86_400), "1969-12-31");
    }

    #[test]
    fn json_like_python() {
        let v = Value::from_pairs([
            ("a", Value::from(1)),
            ("b", Value::from(vec![Value::from(1.5), Value::from(2.0)])),
            ("c", Value::from("é\"\n")),
            ("d", Value::from(())),
        ]);
        let mut s = String::new();
        write_json(&mut s, &v, None, 0).unwrap();
        assert_eq!(s, r#"{"a": 1, "b": [1.5, 2.0], "c": "é\"\n", "d": null}"#);
        let mut s = String::new();
        write_json(&mut s, &v, Some(2), 0).unwrap();
        assert_eq!(
            s,
            "{\n  \"a\": 1,\n  \"b\": [\n    1.5,\n    2.0\n  ],\n  \"c\": \"é\\\"\\n\",\n  \"d\": null\n}"
        );
    }
}
