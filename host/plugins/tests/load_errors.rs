//! Every way loading plugins can fail gives one readable sentence.

mod common;
use common::*;
use moe_plugin_host::Registry;

fn load_err(body: &str) -> String {
    let (_dir, path) = config(body);
    match Registry::from_config_file(&path) {
        Ok(_) => panic!("config unexpectedly loaded:\n{body}"),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "error is not one line: {msg}");
            msg
        }
    }
}

#[test]
fn bundled_plugins_load_and_index() {
    let body = [
        plugin_line("moe_backend_cpu"),
        plugin_line("moe_quant_ggml"),
        plugin_line("moe_policy_basic"),
    ]
    .concat();
    let (_dir, path) = config(&body);
    let reg = Registry::from_config_file(&path).unwrap();
    assert_eq!(reg.plugins.len(), 3);
    assert!(reg.backend("cpu").is_ok());
    assert_eq!(
        reg.quant_format(8).map(|f| f.name.to_string()),
        Some("Q8_0".into())
    );
    assert_eq!(reg.type_size(12), Some((256, 144)));
    assert!(reg.policy("split-by-layer").is_ok());
}

#[test]
fn missing_file() {
    let msg = load_err("[[plugin]]\npath = \"nowhere/libnothing.so\"\n");
    assert!(msg.contains("libnothing.so: no such file"), "{msg}");
}

#[test]
fn missing_library_name_says_how_to_build() {
    let msg = load_err("plugin_dir = \".\"\n[[plugin]]\nlibrary = \"moe_nothing\"\n");
    assert!(
        msg.contains("libmoe_nothing.so: no such file") && msg.contains("cargo build"),
        "{msg}"
    );
}

#[test]
fn file_that_is_not_a_library() {
    let (dir, _) = config("");
    let junk = dir.path().join("libjunk.so");
    std::fs::write(&junk, "this is text, not a shared object\n").unwrap();
    let msg = load_err(&format!("[[plugin]]\npath = {junk:?}\n"));
    assert!(
        msg.contains("not a moeserve plugin") && msg.contains("dynamic loader"),
        "{msg}"
    );
}

#[test]
fn library_that_is_not_a_plugin() {
    // A real shared library without our root module.
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    let Some(libm) = libm else {
        eprintln!("skipped: no libm.so.6 found");
        return;
    };
    let msg = load_err(&format!("[[plugin]]\npath = {libm:?}\n"));
    assert!(
        msg.contains("not a moeserve plugin") && msg.contains("root module"),
        "{msg}"
    );
}

#[test]
fn abi_major_mismatch() {
    let msg = load_err(&plugin_line("bad_plugin_abi_major"));
    let host = format!(
        "{}.{}",
        moe_plugin_api::ABI_MAJOR,
        moe_plugin_api::ABI_MINOR
    );
    assert!(
        msg.contains(&format!(
            "built for plugin ABI 2.0 but this host speaks {host}"
        )) && msg.contains(&format!("rebuild the plugin against moe-plugin-api {host}")),
        "{msg}"
    );
}

#[test]
fn layout_mismatch() {
    let msg = load_err(&plugin_line("bad_plugin_layout_mismatch"));
    assert!(
        msg.contains("its plugin-api types do not match this host's"),
        "{msg}"
    );
    assert!(
        msg.len() < 600,
        "message too long ({} chars): {msg}",
        msg.len()
    );
}

#[test]
fn two_plugins_claim_one_type_id() {
    // A byte-for-byte copy under another name is a second plugin claiming the same ids.
    let (dir, _) = config("");
    let copy = dir.path().join("libggml_copy.so");
    std::fs::copy(lib("moe_quant_ggml"), &copy).unwrap();
    let msg = load_err(&format!(
        "{}[[plugin]]\npath = {copy:?}\n",
        plugin_line("moe_quant_ggml")
    ));
    assert!(
        msg.contains("quant type id 0 is claimed by both 'ggml-quants'"),
        "{msg}"
    );
    assert!(msg.contains("libggml_copy.so"), "{msg}");
}

#[test]
fn unknown_policy_lists_the_known_ones() {
    let msg = load_err(&format!(
        "{}[placement]\npolicy = \"nope\"\n",
        plugin_line("moe_policy_basic")
    ));
    assert_eq!(
        msg,
        "placement policy 'nope' is not provided by any loaded plugin (available: single-device, split-by-layer)"
    );
}

#[test]
fn invalid_toml_names_the_line() {
    let msg = load_err("[devices]\nuse_devices = []\nbackend = cpu\n");
    assert!(
        msg.contains("plugins.toml: invalid TOML at line 3"),
        "{msg}"
    );
    let msg = load_err("[devices]\nbakend = \"cpu\"\n");
    assert!(msg.contains("line 2") && msg.contains("bakend"), "{msg}");
}

#[test]
fn bad_plugin_settings_are_refused() {
    // A private copy of the library: its settings are its own, whatever other tests in
    // this process configured the shared one with.
    let (dir, _) = config("");
    let copy = dir.path().join("libcpu_settings_test.so");
    std::fs::copy(lib("moe_backend_cpu"), &copy).unwrap();
    let msg = load_err(&format!(
        "[[plugin]]\npath = {copy:?}\n[plugin.settings]\nactivation = \"int3\"\n"
    ));
    assert!(
        msg.contains("plugin 'cpu' rejected its settings") && msg.contains("int3"),
        "{msg}"
    );
}

#[test]
fn one_library_cannot_take_two_configurations() {
    let (dir, _) = config("");
    let copy = dir.path().join("libcpu_twice_test.so");
    std::fs::copy(lib("moe_backend_cpu"), &copy).unwrap();
    let with = |threads: u32| {
        format!(
            "{}[[plugin]]\npath = {copy:?}\n[plugin.settings]\nthreads = {threads}\n",
            plugin_line("moe_policy_basic")
        )
    };
    let (_d1, first) = config(&with(1));
    Registry::from_config_file(&first).unwrap();
    // The same settings again are fine (the library is configured once per process).
    let (_d2, same) = config(&with(1));
    Registry::from_config_file(&same).unwrap();
    let msg = load_err(&with(2));
    assert!(
        msg.contains("already loaded in this process with other settings"),
        "{msg}"
    );
}
