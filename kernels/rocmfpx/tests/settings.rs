//! The `fp2` plugin setting as the host applies it: `configure`, then each type-107
//! tensor's `resolve_variant`. The setting is process-wide, so everything that changes it
//! lives in this one test (its own test binary).

mod common;

use common::*;
use moe_plugin_api::{abi_stable::std_types::RStr, into_result};

#[test]
fn configure_then_resolve() {
    let configure = moe_quant_rocmfpx::get_root_module().configure();
    let set = |toml: &str| into_result(configure(RStr::from(toml)));
    let f = format(107);
    let affine = r#"{"general.name": "m", "rocmfpx.fp2_mode": "affine"}"#;
    let two = r#"{"general.name": "m", "rocmfpx.fp2_mode": "two-scale"}"#;

    // No setting: only the key decides.
    set("").unwrap();
    assert!(resolve(&f, "{}").unwrap_err().contains("plugins.toml"));
    assert_eq!(resolve(&f, affine), Ok(2));
    assert_eq!(resolve(&f, two), Ok(1));

    // fp2 = "affine": files without the key are affine; a file saying two-scale conflicts.
    set("fp2 = \"affine\"").unwrap();
    assert_eq!(resolve(&f, "{}"), Ok(2));
    assert_eq!(resolve(&f, affine), Ok(2));
    let e = resolve(&f, two).unwrap_err();
    assert!(e.contains("contradicts"), "{e}");

    // A rejected configure leaves the previous setting in place.
    assert!(set("fp2 = \"sometimes\"").is_err());
    assert_eq!(resolve(&f, "{}"), Ok(2));

    set("fp2 = \"two-scale\"").unwrap();
    assert_eq!(resolve(&f, "{}"), Ok(1));
    assert!(resolve(&f, affine).unwrap_err().contains("contradicts"));

    // Other types ignore it.
    assert_eq!(resolve(&format(103), "{}"), Ok(0));

    // Back to no setting.
    set("").unwrap();
    assert!(resolve(&f, "{}").is_err());
}
