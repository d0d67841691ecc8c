//! Error cases and the SentencePiece path, on small hand-made vocabularies.

use moe_tokenizer::{ChatMessage, ExtraParts, Tokenizer, TokenizerError, TokenizerParts};

/// A tiny byte-level vocabulary: every byte-level character plus a few merges.
fn tiny_gpt2() -> TokenizerParts {
    let mut tokens: Vec<String> = Vec::new();
    // The 256 single-byte stand-ins, in the GPT-2 order.
    let mut shifted = 0u32;
    for b in 0..=255u32 {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        tokens.push(char::from_u32(c).unwrap().to_string());
    }
    for t in ["he", "ll", "hell", "hello", "Ġw", "<|eot|>", "<tool>"] {
        tokens.push(t.to_string());
    }
    let mut types = vec![1; tokens.len()];
    let n = types.len();
    types[n - 2] = 3; // control
    types[n - 1] = 4; // user-defined
    TokenizerParts {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens,
        token_types: Some(types),
        merges: ["h e", "l l", "he ll", "hell o", "Ġ w"]
            .map(String::from)
            .to_vec(),
        eos_id: Some(n as u32 - 2),
        ..Default::default()
    }
}

#[test]
fn tiny_vocab_works() {
    let t = Tokenizer::from_parts(tiny_gpt2()).unwrap();
    let ids = t.encode("hello world", false, false).unwrap();
    assert_eq!(t.token_text(ids[0]), Some("hello"));
    assert_eq!(t.token_text(ids[1]), Some("Ġw"));
    assert_eq!(t.decode(&ids, false).unwrap(), "hello world");
    // User-defined tokens are matched even without parse_special; control only with it.
    let tool = t.vocab_size() as u32 - 1;
    let eot = t.vocab_size() as u32 - 2;
    assert_eq!(t.encode("<tool>", false, false).unwrap(), [tool]);
    assert_eq!(t.encode("<|eot|>", false, true).unwrap(), [eot]);
    assert_ne!(t.encode("<|eot|>", false, false).unwrap(), [eot]);
    assert!(t.is_end_of_generation(eot));
}

#[test]
fn unknown_pre_tokenizer_falls_back_to_gpt2() {
    let mut p = tiny_gpt2();
    p.pre = Some("some-future-model".into());
    let t = Tokenizer::from_parts(p).unwrap();
    assert_eq!(
        t.pre_tokenizer(),
        Some(moe_tokenizer::PreTokenizerKind::Gpt2)
    );
}

#[test]
fn unknown_model_type() {
    let mut p = tiny_gpt2();
    p.model = "t5".into();
    let err = Tokenizer::from_parts(p).unwrap_err();
    assert_eq!(err, TokenizerError::UnsupportedModel("t5".into()));
    assert!(err.to_string().contains("\"t5\" is not supported"), "{err}");
}

#[test]
fn missing_merges() {
    let mut p = tiny_gpt2();
    p.merges.clear();
    let err = Tokenizer::from_parts(p).unwrap_err();
    assert!(matches!(err, TokenizerError::MissingData(_)), "{err:?}");
    assert!(err.to_string().contains("merges"), "{err}");
}

#[test]
fn merge_naming_a_missing_token() {
    let mut p = tiny_gpt2();
    p.merges.push("x nosuchtoken".into());
    let err = Tokenizer::from_parts(p).unwrap_err();
    assert!(matches!(err, TokenizerError::Build(_)), "{err:?}");
}

#[test]
fn empty_vocab_and_bad_type_count() {
    let mut p = tiny_gpt2();
    p.tokens.clear();
    assert!(matches!(
        Tokenizer::from_parts(p),
        Err(TokenizerError::MissingData(_))
    ));
    let mut p = tiny_gpt2();
    p.token_types = Some(vec![1, 1]);
    assert!(matches!(
        Tokenizer::from_parts(p),
        Err(TokenizerError::Build(_))
    ));
}

#[test]
fn no_chat_template() {
    let t = Tokenizer::from_parts(tiny_gpt2()).unwrap();
    let err = t
        .apply_chat_template(&[ChatMessage::new("user", "hi")], true)
        .unwrap_err();
    assert_eq!(err, TokenizerError::NoChatTemplate);
}

#[test]
fn bad_template_reports_the_line() {
    let mut p = tiny_gpt2();
    p.chat_template = Some("{% for m in messages %}\n{{ m.content }\n{% endfor %}\n".to_string());
    // A broken template does not stop the tokenizer from loading.
    let t = Tokenizer::from_parts(p).unwrap();
    let err = t
        .apply_chat_template(&[ChatMessage::new("user", "hi")], true)
        .unwrap_err();
    let TokenizerError::Template { line, message } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*line, Some(2));
    assert!(message.contains("syntax error"), "{message}");
    assert!(err.to_string().contains("line 2"), "{err}");
}

#[test]
fn raise_exception_and_runtime_errors_carry_message_and_line() {
    let mut p = tiny_gpt2();
    p.chat_template = Some(
        "{% if messages[0].role != 'system' %}\n{{ raise_exception('System message required') }}\n{% endif %}"
            .to_string(),
    );
    let t = Tokenizer::from_parts(p).unwrap();
    let err = t
        .apply_chat_template(&[ChatMessage::new("user", "hi")], false)
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("System message required"), "{text}");
    assert!(text.contains("line 2"), "{text}");

    let err = t.apply_template("ok\n{{ 1 + }}", &[], false).unwrap_err();
    assert!(err.to_string().contains("line 2"), "{err}");
}

/// A small SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, byte tokens, pieces.
fn tiny_spm() -> (TokenizerParts, ExtraParts) {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u32 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("w", -2.0),
        ("r", -2.0),
        ("d", -2.0),
        ("▁h", -3.0),
        ("ll", -3.5),
        ("▁he", -4.0),
        ("▁hell", -5.0),
        ("▁hello", -6.0),
        ("▁w", -3.0),
        ("or", -3.2),
        ("ld", -3.3),
        ("▁wor", -4.5),
        ("▁world", -5.5),
    ];
    for (t, s) in pieces {
        tokens.push(t.to_string());
        types.push(1);
        scores.push(s);
    }
    let parts = TokenizerParts {
        model: "llama".into(),
        tokens,
        token_types: Some(types),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        add_bos: true,
        ..Default::default()
    };
    let extra = ExtraParts {
        scores: Some(scores),
        add_space_prefix: Some(true),
    };
    (parts, extra)
}

#[test]
fn sentencepiece_bpe() {
    let (p, extra) = tiny_spm();
    let t = Tokenizer::from_parts_with(p, extra).unwrap();
    assert_eq!(t.model_type(), "llama");
    let ids = t.encode("hello world", true, true).unwrap();
    let texts: Vec<&str> = ids.iter().map(|&i| t.token_text(i).unwrap()).collect();
    assert_eq!(texts, ["<s>", "▁hello", "▁world"]);
    assert_eq!(t.decode(&ids, true).unwrap(), "hello world");
    assert_eq!(t.decode(&ids, false).unwrap(), "<s>hello world");
    assert_eq!(t.decode(&ids[1..], false).unwrap(), "hello world");
    // "é" is not a piece: it is spelled with byte tokens, and decodes back.
    let ids = t.encode("hé", false, false).unwrap();
    let texts: Vec<&str> = ids.iter().map(|&i| t.token_text(i).unwrap()).collect();
    assert_eq!(texts, ["▁h", "<0xC3>", "<0xA9>"]);
    assert_eq!(t.decode(&ids, false).unwrap(), "hé");
    assert_eq!(t.token_bytes(ids[1]).unwrap(), [0xC3]);
    // Control tokens in text.
    let ids = t.encode("</s>", false, true).unwrap();
    assert_eq!(ids, [2]);
    assert!(t.is_end_of_generation(2));
}

#[test]
fn sentencepiece_needs_scores() {
    let (p, _) = tiny_spm();
    let err = Tokenizer::from_parts(p).unwrap_err();
    assert!(err.to_string().contains("scores"), "{err}");
}
