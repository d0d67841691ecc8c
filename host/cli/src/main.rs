//! `moeserve`: serve models through an OpenAI-compatible API, and the tools around it.

mod plugins_cmd;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "moeserve", version, about = "Plugin-based MoE inference server")]
struct Cli {
    /// Plugin configuration (default: plugins.toml in the current folder).
    #[arg(long, global = true, default_value = "plugins.toml")]
    config: PathBuf,
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the loaded plugins, quant formats, devices and placement policies.
    Plugins,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Command::Plugins => plugins_cmd::run(&cli.config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the chain of contexts, outermost first.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
