//! Built-in block layouts of the standard ggml tensor types.
//!
//! Checked against `GGML_QUANT_SIZES` of the PyPI `gguf` package 0.19.0, with one deliberate
//! difference: Q8_1 is 36 bytes as in ggml's `block_q8_1` (two f16 + 32 i8, static_assert'ed in
//! ggml-common.h); gguf-py still says 40, from when `d` and `s` were f32. Ids that ggml retired
//! (4, 5, 31-33, 36-38) are absent: a file using them is refused as unknown.

/// Block layout of a tensor type: `(weights per block, bytes per block)`, or `None` if unclaimed.
/// The host builds one from its loaded quant plugins; [`ggml_type_size`] is the built-in table.
pub type TypeSizeFn<'a> = &'a dyn Fn(u32) -> Option<(u32, u32)>;

// (id, name as ggml prints it, weights per block, bytes per block)
const TYPES: &[(u32, &str, u32, u32)] = &[
    (0, "f32", 1, 4),
    (1, "f16", 1, 2),
    (2, "q4_0", 32, 18),
    (3, "q4_1", 32, 20),
    (6, "q5_0", 32, 22),
    (7, "q5_1", 32, 24),
    (8, "q8_0", 32, 34),
    (9, "q8_1", 32, 36),
    (10, "q2_K", 256, 84),
    (11, "q3_K", 256, 110),
    (12, "q4_K", 256, 144),
    (13, "q5_K", 256, 176),
    (14, "q6_K", 256, 210),
    (15, "q8_K", 256, 292),
    (16, "iq2_xxs", 256, 66),
    (17, "iq2_xs", 256, 74),
    (18, "iq3_xxs", 256, 98),
    (19, "iq1_s", 256, 50),
    (20, "iq4_nl", 32, 18),
    (21, "iq3_s", 256, 110),
    (22, "iq2_s", 256, 82),
    (23, "iq4_xs", 256, 136),
    (24, "i8", 1, 1),
    (25, "i16", 1, 2),
    (26, "i32", 1, 4),
    (27, "i64", 1, 8),
    (28, "f64", 1, 8),
    (29, "iq1_m", 256, 56),
    (30, "bf16", 1, 2),
    (34, "tq1_0", 256, 54),
    (35, "tq2_0", 256, 66),
    (39, "mxfp4", 32, 17),
    (40, "nvfp4", 64, 36),
    (41, "q1_0", 128, 18),
];

fn find(type_id: u32) -> Option<&'static (u32, &'static str, u32, u32)> {
    TYPES.iter().find(|t| t.0 == type_id)
}

/// `(weights per block, bytes per block)` of a standard ggml type.
pub fn ggml_type_size(type_id: u32) -> Option<(u32, u32)> {
    find(type_id).map(|t| (t.2, t.3))
}

/// ggml's name of a standard type ("f32", "q8_0", "q4_K", "mxfp4", ...).
pub fn ggml_type_name(type_id: u32) -> Option<&'static str> {
    find(type_id).map(|t| t.1)
}
