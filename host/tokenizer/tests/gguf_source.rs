//! When the SmolLM2 GGUF is present, check that the committed fixture still holds
//! exactly its tokenizer metadata, and that a tokenizer built straight from the
//! file encodes the corpus as the reference did. Skips (with a message) otherwise.
//!
//! The GGUF metadata is read with a few lines of test code (the workspace's GGUF
//! reader lives in another crate).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::PathBuf;

use moe_tokenizer::{Tokenizer, TokenizerParts};

#[derive(Debug, Clone, PartialEq)]
enum Meta {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
}

struct Reader<R: Read>(R);

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        self.0.read_exact(&mut b).unwrap();
        b
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        String::from_utf8(b).unwrap()
    }
    fn value(&mut self, ty: u32) -> Meta {
        match ty {
            0 => Meta::Int(self.bytes::<1>()[0] as i64),
            1 => Meta::Int(self.bytes::<1>()[0] as i8 as i64),
            2 => Meta::Int(u16::from_le_bytes(self.bytes()) as i64),
            3 => Meta::Int(i16::from_le_bytes(self.bytes()) as i64),
            4 => Meta::Int(self.u32() as i64),
            5 => Meta::Int(i32::from_le_bytes(self.bytes()) as i64),
            6 => Meta::Float(f32::from_le_bytes(self.bytes()) as f64),
            7 => Meta::Bool(self.bytes::<1>()[0] != 0),
            8 => Meta::Str(self.string()),
            9 => {
                let elem = self.u32();
                let n = self.u64();
                Meta::Array((0..n).map(|_| self.value(elem)).collect())
            }
            10 => Meta::Int(self.u64() as i64),
            11 => Meta::Int(i64::from_le_bytes(self.bytes())),
            12 => Meta::Float(f64::from_le_bytes(self.bytes())),
            other => panic!("unknown GGUF value type {other}"),
        }
    }
}

fn read_metadata(path: &PathBuf) -> HashMap<String, Meta> {
    let mut r = Reader(BufReader::new(File::open(path).unwrap()));
    assert_eq!(&r.bytes::<4>(), b"GGUF");
    let version = r.u32();
    assert!(version >= 2, "GGUF version {version}");
    let _tensors = r.u64();
    let kvs = r.u64();
    (0..kvs)
        .map(|_| {
            let key = r.string();
            let ty = r.u32();
            (key, r.value(ty))
        })
        .collect()
}

fn parts_from_gguf(meta: &HashMap<String, Meta>) -> TokenizerParts {
    let s = |k: &str| match meta.get(k) {
        Some(Meta::Str(s)) => Some(s.clone()),
        _ => None,
    };
    let id = |k: &str| match meta.get(k) {
        Some(Meta::Int(i)) => Some(*i as u32),
        _ => None,
    };
    let flag = |k: &str| matches!(meta.get(k), Some(Meta::Bool(true)));
    let strings = |k: &str| match meta.get(k) {
        Some(Meta::Array(a)) => a
            .iter()
            .map(|v| match v {
                Meta::Str(s) => s.clone(),
                other => panic!("{k}: {other:?}"),
            })
            .collect(),
        _ => Vec::new(),
    };
    TokenizerParts {
        model: s("tokenizer.ggml.model").unwrap(),
        pre: s("tokenizer.ggml.pre"),
        tokens: strings("tokenizer.ggml.tokens"),
        token_types: match meta.get("tokenizer.ggml.token_type") {
            Some(Meta::Array(a)) => Some(
                a.iter()
                    .map(|v| match v {
                        Meta::Int(i) => *i as i32,
                        other => panic!("token_type {other:?}"),
                    })
                    .collect(),
            ),
            _ => None,
        },
        merges: strings("tokenizer.ggml.merges"),
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_id: id("tokenizer.ggml.eos_token_id"),
        unk_id: id("tokenizer.ggml.unknown_token_id"),
        pad_id: id("tokenizer.ggml.padding_token_id"),
        eot_ids: ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
            .iter()
            .filter_map(|k| id(k))
            .collect(),
        add_bos: flag("tokenizer.ggml.add_bos_token"),
        add_eos: flag("tokenizer.ggml.add_eos_token"),
        chat_template: s("tokenizer.chat_template"),
    }
}

#[test]
fn fixture_matches_the_gguf() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        println!("SKIPPED: {} not present", path.display());
        return;
    }
    let from_file = parts_from_gguf(&read_metadata(&path));

    let fixture: serde_json::Value = {
        let f = File::open(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/smollm2_tokenizer.json.gz"
        ))
        .unwrap();
        let mut s = String::new();
        flate2::read::GzDecoder::new(f)
            .read_to_string(&mut s)
            .unwrap();
        serde_json::from_str(&s).unwrap()
    };
    assert_eq!(fixture["model"], from_file.model.as_str());
    assert_eq!(fixture["pre"].as_str(), from_file.pre.as_deref());
    assert_eq!(fixture["tokens"], serde_json::json!(from_file.tokens));
    assert_eq!(
        fixture["token_types"],
        serde_json::json!(from_file.token_types)
    );
    assert_eq!(fixture["merges"], serde_json::json!(from_file.merges));
    assert_eq!(fixture["bos_id"], serde_json::json!(from_file.bos_id));
    assert_eq!(fixture["eos_id"], serde_json::json!(from_file.eos_id));
    assert_eq!(fixture["add_bos"], from_file.add_bos);
    assert_eq!(
        fixture["chat_template"].as_str(),
        from_file.chat_template.as_deref()
    );

    let t = Tokenizer::from_parts(from_file).unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/smollm2_expected.json"
        ))
        .unwrap(),
    )
    .unwrap();
    for case in expected["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = t.encode(text, false, true).unwrap();
        assert_eq!(serde_json::json!(ids), case["ids"], "{text:?}");
    }
}
