//! Checkpoint tensor names -> deepseek4 GGUF names (those of llama.cpp's converter and
//! lucebox's loader). Accepts save_pretrained's names (`model.` prefix, `attn.norm`,
//! `embed_tokens`, `hc_head.hc_fn`) and the release's (`embed`, `hc_head_fn`, `attn.kv_norm`).

/// How a tensor is stored in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A projection matrix: stored in the requested `--type`.
    Matrix,
    /// Norm weights, mHC mixers, sinks, position biases, the router: kept f32 (small,
    /// and they steer selections that low precision would flip).
    Control,
    /// The hash-routing table, stored as I32.
    Table,
}

pub struct Mapped {
    pub gguf: String,
    pub kind: Kind,
}

/// Strips the `model.` prefix save_pretrained adds.
pub fn base_name(name: &str) -> &str {
    name.strip_prefix("model.").unwrap_or(name)
}

pub fn map(name: &str) -> Option<Mapped> {
    let n = base_name(name);
    let m = |g: &str, kind| {
        Some(Mapped {
            gguf: g.to_string(),
            kind,
        })
    };
    match n {
        "embed_tokens.weight" | "embed.weight" => return m("token_embd.weight", Kind::Matrix),
        "norm.weight" => return m("output_norm.weight", Kind::Control),
        "head.weight" | "lm_head.weight" => return m("output.weight", Kind::Matrix),
        "hc_head.hc_fn" | "hc_head_fn" => return m("output_hc_fn.weight", Kind::Control),
        "hc_head.hc_base" | "hc_head_base" => return m("output_hc_base.weight", Kind::Control),
        "hc_head.hc_scale" | "hc_head_scale" => return m("output_hc_scale.weight", Kind::Control),
        _ => {}
    }
    let rest = n.strip_prefix("layers.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    use Kind::*;
    let (g, kind) = match leaf {
        "hc_attn_fn" => ("hc_attn_fn.weight", Control),
        "hc_attn_base" => ("hc_attn_base.weight", Control),
        "hc_attn_scale" => ("hc_attn_scale.weight", Control),
        "hc_ffn_fn" => ("hc_ffn_fn.weight", Control),
        "hc_ffn_base" => ("hc_ffn_base.weight", Control),
        "hc_ffn_scale" => ("hc_ffn_scale.weight", Control),
        "attn_norm.weight" => ("attn_norm.weight", Control),
        "ffn_norm.weight" => ("ffn_norm.weight", Control),
        "attn.attn_sink" => ("attn_sinks.weight", Control),
        "attn.wq_a.weight" => ("attn_q_a.weight", Matrix),
        "attn.wq_b.weight" => ("attn_q_b.weight", Matrix),
        "attn.q_norm.weight" => ("attn_q_a_norm.weight", Control),
        "attn.wkv.weight" => ("attn_kv.weight", Matrix),
        "attn.norm.weight" | "attn.kv_norm.weight" => ("attn_kv_a_norm.weight", Control),
        "attn.wo_a.weight" => ("attn_output_a.weight", Matrix),
        "attn.wo_b.weight" => ("attn_output_b.weight", Matrix),
        "attn.compressor.ape" => ("attn_compressor_ape.weight", Control),
        "attn.compressor.wkv.weight" => ("attn_compressor_kv.weight", Matrix),
        "attn.compressor.wgate.weight" => ("attn_compressor_gate.weight", Matrix),
        "attn.compressor.norm.weight" => ("attn_compressor_norm.weight", Control),
        "attn.indexer.wq_b.weight" => ("indexer.attn_q_b.weight", Matrix),
        "attn.indexer.weights_proj.weight" => ("indexer.proj.weight", Matrix),
        "attn.indexer.compressor.ape" => ("indexer_compressor_ape.weight", Control),
        "attn.indexer.compressor.wkv.weight" => ("indexer_compressor_kv.weight", Matrix),
        "attn.indexer.compressor.wgate.weight" => ("indexer_compressor_gate.weight", Matrix),
        "attn.indexer.compressor.norm.weight" => ("indexer_compressor_norm.weight", Control),
        "ffn.gate.weight" => ("ffn_gate_inp.weight", Control),
        "ffn.gate.bias" => ("exp_probs_b.bias", Control),
        "ffn.gate.tid2eid" => ("ffn_gate_tid2eid.weight", Table),
        "ffn.shared_experts.w1.weight" => ("ffn_gate_shexp.weight", Matrix),
        "ffn.shared_experts.w2.weight" => ("ffn_down_shexp.weight", Matrix),
        "ffn.shared_experts.w3.weight" => ("ffn_up_shexp.weight", Matrix),
        // An MTP block's own tensors (`convert --mtp` names them as layer N's; its
        // e_proj / h_proj are joined into nextn.eh_proj by the converter).
        "nextn.enorm.weight" => ("nextn.enorm.weight", Control),
        "nextn.hnorm.weight" => ("nextn.hnorm.weight", Control),
        "nextn.shared_head_norm.weight" => ("nextn.shared_head_norm.weight", Control),
        _ => return None,
    };
    Some(Mapped {
        gguf: format!("blk.{layer}.{g}"),
        kind,
    })
}

/// `convert --mtp`: the checkpoint name an MTP file reads a release tensor under (the
/// names llama.cpp's converter gives with `--mtp`), or None for a tensor it leaves out.
/// MTP block 0 becomes layer `block` (the first after the main layers): its own mHC head
/// replaces the model's, its `norm` is the shared head's norm; the embedding, the final
/// norm and the output head are kept from the main model.
pub fn mtp_name(name: &str, block: usize) -> anyhow::Result<Option<String>> {
    let n = base_name(name);
    if let Some(rest) = n.strip_prefix("mtp.") {
        let (i, leaf) = rest
            .split_once('.')
            .ok_or_else(|| anyhow::anyhow!("unexpected MTP tensor '{name}'"))?;
        if i != "0" {
            anyhow::bail!(
                "'{name}': only MTP block 0 is converted (one next-token block, as llama.cpp reads them)"
            );
        }
        return Ok(Some(match leaf {
            "hc_head_fn" | "hc_head_base" | "hc_head_scale" => leaf.to_string(),
            "e_proj.weight" | "e_proj.scale" | "h_proj.weight" | "h_proj.scale"
            | "enorm.weight" | "hnorm.weight" => format!("layers.{block}.nextn.{leaf}"),
            "norm.weight" => format!("layers.{block}.nextn.shared_head_norm.weight"),
            _ => format!("layers.{block}.{leaf}"),
        }));
    }
    let kept = matches!(
        n,
        "embed.weight"
            | "embed_tokens.weight"
            | "norm.weight"
            | "head.weight"
            | "head.scale"
            | "lm_head.weight"
    );
    Ok(kept.then(|| name.to_string()))
}

/// `layers.N.ffn.experts.E.wK.weight` -> (N, E, K).
pub fn expert(name: &str) -> Option<(usize, usize, u8)> {
    let rest = base_name(name).strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once(".ffn.experts.")?;
    let (e, rest) = rest.split_once(".w")?;
    let (k, suffix) = rest.split_once('.')?;
    if suffix != "weight" && suffix != "scale" {
        return None;
    }
    Some((layer.parse().ok()?, e.parse().ok()?, k.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_naming_styles_map_to_one_name() {
        for n in [
            "model.layers.3.attn.norm.weight",
            "layers.3.attn.kv_norm.weight",
        ] {
            assert_eq!(map(n).unwrap().gguf, "blk.3.attn_kv_a_norm.weight");
        }
        assert_eq!(map("embed.weight").unwrap().gguf, "token_embd.weight");
        assert_eq!(
            map("model.hc_head.hc_fn").unwrap().gguf,
            "output_hc_fn.weight"
        );
        assert_eq!(
            expert("model.layers.2.ffn.experts.17.w3.weight"),
            Some((2, 17, 3))
        );
        assert_eq!(expert("layers.0.ffn.experts.1.w2.scale"), Some((0, 1, 2)));
        assert!(map("model.layers.1.attn.mystery.weight").is_none());
    }

    #[test]
    fn mtp_block_takes_the_layer_after_the_main_ones() {
        let m = |n: &str| mtp_name(n, 43).unwrap();
        for (from, to) in [
            ("mtp.0.attn.wq_a.weight", "layers.43.attn.wq_a.weight"),
            (
                "mtp.0.ffn.experts.5.w1.scale",
                "layers.43.ffn.experts.5.w1.scale",
            ),
            ("mtp.0.e_proj.weight", "layers.43.nextn.e_proj.weight"),
            (
                "mtp.0.norm.weight",
                "layers.43.nextn.shared_head_norm.weight",
            ),
        ] {
            assert_eq!(m(from).as_deref(), Some(to), "{from}");
        }
        // its own mHC head replaces the model's; the model's embedding and head stay
        assert_eq!(m("mtp.0.hc_head_fn").as_deref(), Some("hc_head_fn"));
        assert_eq!(m("hc_head_fn"), None);
        assert_eq!(m("embed.weight").as_deref(), Some("embed.weight"));
        assert_eq!(m("head.weight").as_deref(), Some("head.weight"));
        assert_eq!(m("layers.7.attn.wq_a.weight"), None);
        // then mapped as any layer's, and the nextn norms by name
        assert_eq!(
            map("layers.43.nextn.hnorm.weight").unwrap().gguf,
            "blk.43.nextn.hnorm.weight"
        );
        assert!(mtp_name("mtp.1.attn.wq_a.weight", 43).is_err());
    }
}
