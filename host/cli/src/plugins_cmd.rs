//! `moeserve plugins`: what the config loaded.

use std::path::Path;

use anyhow::Result;
use moe_plugin_api::into_result;
use moe_plugin_host::Registry;

pub fn run(config: &Path) -> Result<()> {
    let reg = Registry::from_config_file(config)?;
    println!("config: {}", config.display());
    println!(
        "{:<18} {:<10} {:<8} {:<5} path",
        "plugin", "kind", "version", "abi"
    );
    for p in &reg.plugins {
        println!(
            "{:<18} {:<10} {:<8} {:<5} {}",
            p.info.name,
            p.info.kind.as_str(),
            p.info.version,
            p.abi.to_string(),
            p.path.display()
        );
        println!("{:<18} {}", "", p.info.description);
    }
    println!("\nquant formats (type id, name, weights/bytes per block, plugin):");
    for p in &reg.plugins {
        for f in &p.quant_formats {
            println!(
                "  {:>4}  {:<12} {:>4} w / {:>4} B  {}",
                f.type_id, f.name, f.block_weights, f.block_bytes, p.info.name
            );
        }
    }
    println!("\ndevices:");
    for p in &reg.plugins {
        if let Some(b) = &p.backend {
            match into_result((b.devices)()) {
                Ok(devs) if devs.is_empty() => println!("  {}: no devices present", b.name),
                Ok(devs) => {
                    for d in devs.iter() {
                        println!(
                            "  {}:{}  {:<8} {}  {:.1} GiB  {:.1} GB/s{}",
                            b.name,
                            d.index,
                            d.arch,
                            d.name,
                            d.memory_bytes as f64 / (1u64 << 30) as f64,
                            d.bandwidth_bytes_per_s / 1e9,
                            if d.unified_memory {
                                "  unified memory"
                            } else {
                                ""
                            }
                        );
                    }
                }
                Err(e) => println!("  {}: unavailable: {e}", b.name),
            }
        }
    }
    println!("\nplacement policies:");
    let selected = &reg.config.placement.policy;
    for p in &reg.plugins {
        for pol in &p.policies {
            let mark = if pol.name.as_str() == selected {
                "*"
            } else {
                " "
            };
            println!(
                "  {mark} {:<16} {} ({})",
                pol.name, pol.description, p.info.name
            );
        }
    }
    println!(
        "\nmodel backend: {} (devices {:?})",
        reg.config.devices.backend, reg.config.devices.use_devices
    );
    // The listing is printed either way; a model backend that could not run a model
    // (unavailable, no devices, or not the devices use_devices names) is an error.
    let be = reg.backend(&reg.config.devices.backend)?;
    let devs: Vec<u32> = into_result((be.devices)())
        .map_err(|e| anyhow::anyhow!("model backend '{}' is unavailable: {e}", be.name))?
        .iter()
        .map(|d| d.index)
        .collect();
    let wanted = &reg.config.devices.use_devices;
    if let Some(missing) = wanted.iter().find(|i| !devs.contains(i)) {
        anyhow::bail!(
            "use_devices names {}:{missing}, which is not present (devices: {devs:?})",
            be.name
        );
    }
    if devs.is_empty() {
        anyhow::bail!("model backend '{}' has no devices", be.name);
    }
    Ok(())
}
