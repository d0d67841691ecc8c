//! Placement policies are chosen by plugins.toml, and a third-party quant plugin built
//! as an outside crate runs in a real matrix product on the CPU backend.

mod common;
use common::*;
use moe_plugin_api::{
    abi_stable::std_types::{RNone, RVec},
    into_result, Assignment, DeviceInfo, Phase, PlacementRequest, TensorMeta,
};
use moe_plugin_host::Registry;

fn device(i: u32, gib: u64) -> DeviceInfo {
    DeviceInfo {
        index: i,
        name: format!("dev{i}").into(),
        arch: if i == 0 { "gfx1100" } else { "gfx1151" }.into(),
        memory_bytes: gib << 30,
        bandwidth_bytes_per_s: 1e11,
        unified_memory: i == 1,
    }
}

fn inventory() -> RVec<TensorMeta> {
    let mut v = vec![("token_embd.weight".to_string(), -1, "embedding")];
    for l in 0..8 {
        v.push((format!("blk.{l}.attn_q.weight"), l, "attention"));
        v.push((format!("blk.{l}.ffn_up.weight"), l, "dense_ffn"));
    }
    v.push(("output.weight".into(), -1, "output"));
    v.into_iter()
        .map(|(name, layer, role)| TensorMeta {
            name: name.into(),
            shape: RVec::from(vec![64u64, 64]),
            type_id: 8,
            bytes: 64 * 64 / 32 * 34,
            layer,
            n_experts: 0,
            role: role.into(),
        })
        .collect()
}

fn place_with(policy: &str) -> Vec<Assignment> {
    let (_dir, path) = config(&format!(
        "{}[placement]\npolicy = \"{policy}\"\n",
        plugin_line("moe_policy_basic")
    ));
    let reg = Registry::from_config_file(&path).unwrap();
    let pol = reg.policy(&reg.config.placement.policy).unwrap();
    let req = PlacementRequest {
        devices: RVec::from(vec![device(0, 20), device(1, 60)]),
        tensors: inventory(),
        phase: Phase::Decode,
        routing_profile: RNone,
        settings_toml: "".into(),
    };
    into_result((pol.place)(&req))
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn switching_policy_in_config_changes_the_assignment() {
    let single = place_with("single-device");
    let split = place_with("split-by-layer");
    assert_eq!(single.len(), 18);
    assert_eq!(split.len(), 18);
    assert!(single.iter().all(|a| a.device == 0 && !a.reason.is_empty()));
    let dev_of = |name: &str| {
        split
            .iter()
            .find(|a| a.tensor.as_str() == name)
            .unwrap()
            .device
    };
    // 20 GiB + 60 GiB: a quarter of the 8 layers on device 0, the rest on device 1.
    assert_eq!(dev_of("blk.0.attn_q.weight"), 0);
    assert_eq!(dev_of("blk.1.ffn_up.weight"), 0);
    assert_eq!(dev_of("blk.2.attn_q.weight"), 1);
    assert_eq!(dev_of("blk.7.ffn_up.weight"), 1);
    assert_eq!(dev_of("token_embd.weight"), 0);
    assert_eq!(dev_of("output.weight"), 1);
    assert_ne!(single, split);
}

#[test]
fn third_party_quant_plugin_runs_a_matmul_on_the_cpu_backend() {
    let body = [
        plugin_line("moe_backend_cpu"),
        plugin_line("third_party_quant_example"),
        plugin_line("moe_policy_basic"),
    ]
    .concat();
    let (_dir, path) = config(&body);
    let reg = Registry::from_config_file(&path).unwrap();
    let fmt = reg.quant_format(200).expect("Q8_S registered").clone();
    assert_eq!(fmt.name.as_str(), "Q8_S");
    let be = reg.backend("cpu").unwrap();
    into_result((be.register_quant_formats)(
        reg.quant_formats().cloned().collect(),
    ))
    .unwrap();

    let (k, m, n) = (128usize, 48usize, 3usize);
    let mut seed = fresh_seed();
    let w: Vec<f32> = (0..k * m).map(|_| lcg(&mut seed)).collect();
    let x: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
    let mut wq = vec![0u8; k * m / 32 * 36];
    into_result((fmt.encode)(
        0,
        w.as_slice().into(),
        wq.as_mut_slice().into(),
    ))
    .unwrap();
    let mut wd = vec![0f32; k * m];
    into_result((fmt.decode)(
        0,
        wq.as_slice().into(),
        wd.as_mut_slice().into(),
    ))
    .unwrap();
    let out = backend_matmul(be, &wq, 200, k, m, &x);
    // Activations go through q8_1 (error <= d/2 per value): 2% of the magnitude sum.
    check_matmul("Q8_S", &wd, &x, k, m, &out, 0.02);
    let counters: Vec<(String, u64)> = (be.kernel_counters)()
        .into_iter()
        .map(|t| (t.0.into(), t.1))
        .collect();
    assert!(
        counters
            .iter()
            .any(|(k, v)| k == "matmul_q8_dot" && *v >= 1),
        "{counters:?}"
    );
}
