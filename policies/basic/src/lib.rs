//! Two placement policies:
//! * `single-device`: every tensor on one device (settings: `device = N`, default 0);
//! * `split-by-layer`: contiguous runs of transformer blocks per device, sized by each
//!   device's memory; embeddings go with the first block, the output head with the last.

use moe_plugin_api::{
    abi_stable::{
        export_root_module,
        prefix_type::PrefixTypeTrait,
        std_types::{RResult, RString, RVec},
    },
    defaults, guard, AbiVersion, Assignment, PlacementPolicy, PlacementRequest, Plugin, PluginInfo,
    PluginKind, PluginRef,
};
use serde::Deserialize;

#[export_root_module]
pub fn get_root_module() -> PluginRef {
    Plugin {
        abi: AbiVersion::CURRENT,
        info,
        configure: defaults::accept_any_settings,
        quant_formats: defaults::no_quant_formats,
        backend: defaults::no_backend,
        policies,
    }
    .leak_into_prefix()
}

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        name: "basic-placement".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        kind: PluginKind::PlacementPolicy,
        description: "single-device and split-by-layer placement".into(),
    }
}

extern "C" fn policies() -> RVec<PlacementPolicy> {
    RVec::from(vec![
        PlacementPolicy {
            name: "single-device".into(),
            description: "every tensor on one device (setting: device)".into(),
            place: place_single,
        },
        PlacementPolicy {
            name: "split-by-layer".into(),
            description: "contiguous blocks of layers per device, in proportion to memory".into(),
            place: place_split,
        },
    ])
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SingleSettings {
    #[serde(default)]
    device: u32,
}

fn settings<T: for<'de> Deserialize<'de> + Default>(text: &str) -> Result<T, String> {
    toml::from_str(text).map_err(|e| format!("placement settings: {}", e.message()))
}

extern "C" fn place_single(req: &PlacementRequest) -> RResult<RVec<Assignment>, RString> {
    guard("single-device", || {
        let s: SingleSettings = settings(req.settings_toml.as_str())?;
        let dev = req
            .devices
            .iter()
            .position(|d| d.index == s.device)
            .ok_or_else(|| {
                format!(
                    "single-device: device {} is not among the {} selected",
                    s.device,
                    req.devices.len()
                )
            })?;
        let reason = RString::from(format!(
            "single-device policy: everything on device {}",
            s.device
        ));
        Ok(req
            .tensors
            .iter()
            .map(|t| Assignment {
                tensor: t.name.clone(),
                expert: -1,
                device: dev as u32,
                reason: reason.clone(),
            })
            .collect())
    })
}

/// Splits `n_layers` into contiguous runs with sizes proportional to `weights`.
pub fn split_layers(n_layers: usize, weights: &[f64]) -> Vec<usize> {
    let total: f64 = weights.iter().sum();
    let mut owner = Vec::with_capacity(n_layers);
    let mut acc = 0.0;
    let mut dev = 0;
    for l in 0..n_layers {
        // Layer l goes to the device whose cumulative share covers its midpoint.
        let mid = (l as f64 + 0.5) / n_layers as f64 * total;
        while dev + 1 < weights.len() && mid > acc + weights[dev] {
            acc += weights[dev];
            dev += 1;
        }
        owner.push(dev);
    }
    owner
}

extern "C" fn place_split(req: &PlacementRequest) -> RResult<RVec<Assignment>, RString> {
    guard("split-by-layer", || {
        let _: SingleSettings = settings(req.settings_toml.as_str())?;
        if req.devices.is_empty() {
            return Err("split-by-layer: no devices".into());
        }
        let n_layers = req
            .tensors
            .iter()
            .map(|t| t.layer + 1)
            .max()
            .unwrap_or(0)
            .max(0) as usize;
        let weights: Vec<f64> = req
            .devices
            .iter()
            .map(|d| d.memory_bytes.max(1) as f64)
            .collect();
        let owner = split_layers(n_layers, &weights);
        let last = owner.last().copied().unwrap_or(0);
        Ok(req
            .tensors
            .iter()
            .map(|t| {
                let (device, reason) = if t.layer >= 0 {
                    let d = owner[t.layer as usize];
                    (
                        d,
                        format!(
                            "layer {} of {n_layers} falls in device {d}'s share of memory",
                            t.layer
                        ),
                    )
                } else if t.role.as_str() == "output" {
                    (last, "output head goes with the last layer".to_string())
                } else {
                    (0, "outside the blocks: with the first layer".to_string())
                };
                Assignment {
                    tensor: t.name.clone(),
                    expert: -1,
                    device: device as u32,
                    reason: reason.into(),
                }
            })
            .collect())
    })
}

#[cfg(test)]
mod tests {
    use super::split_layers;

    #[test]
    fn split_is_contiguous_and_proportional() {
        assert_eq!(split_layers(4, &[1.0, 1.0]), vec![0, 0, 1, 1]);
        assert_eq!(split_layers(4, &[3.0, 1.0]), vec![0, 0, 0, 1]);
        assert_eq!(split_layers(3, &[1.0]), vec![0, 0, 0]);
    }
}
