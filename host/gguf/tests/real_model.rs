//! Opens the real SmolLM2 GGUF when it has been fetched into .cache/models (CI does that first).
mod common;

use common::*;
use moe_gguf::GgufFile;

#[test]
fn smollm2_q4_1() {
    let path = workspace_root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        println!("skipped: {} not found", path.display());
        return;
    }
    let f = GgufFile::open(&path, SIZES).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.get_u64("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    let emb = f.tensor("token_embd.weight").expect("token_embd.weight");
    assert_eq!(emb.dims, [576, 49152]);
    assert_eq!(emb.type_id, 8);
    assert_eq!(emb.n_bytes, 576 / 32 * 34 * 49152);
    assert_eq!(f.tensor_data(emb).len() as u64, emb.n_bytes);
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );
    // The data section and every tensor lie inside the file.
    let size = f.bytes().len() as u64;
    for t in f.tensors() {
        assert!(f.data_offset() + t.offset + t.n_bytes <= size, "{}", t.name);
    }
    // The JSON for quant plugins parses and holds the scalars only.
    let json: serde_json::Value = serde_json::from_str(&f.scalar_metadata_json()).unwrap();
    assert_eq!(json["llama.block_count"], 30);
    assert!(json.get("tokenizer.ggml.tokens").is_none());
}
