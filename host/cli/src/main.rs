//! `moeserve`: serve models through an OpenAI-compatible API, and the tools around it.

mod eval_cmd;
mod plugins_cmd;
mod serve_cmd;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "moeserve",
    version,
    about = "Plugin-based MoE inference server"
)]
struct Cli {
    /// Plugin configuration (default: plugins.toml in the current folder).
    #[arg(long, global = true, default_value = "plugins.toml")]
    config: PathBuf,
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model through the OpenAI-compatible API.
    Serve(serve_cmd::ServeArgs),
    /// List the loaded plugins, quant formats, devices and placement policies.
    Plugins,
    /// Write float32 logits [T, vocab] for every position of a token sequence (.npy).
    Logits {
        #[arg(long)]
        model: PathBuf,
        /// Comma-separated token ids.
        #[arg(long)]
        tokens: String,
        #[arg(long)]
        out: PathBuf,
        /// `prefill` (one batched pass) or `decode` (one token at a time, with caches).
        #[arg(long, default_value = "prefill")]
        mode: String,
    },
    /// Greedy continuation of a prompt, printed as it is produced.
    Generate {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Use the prompt as is instead of the model's chat template.
        #[arg(long)]
        raw: bool,
    },
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
        Command::Serve(args) => serve_cmd::run(cli.config, args),
        Command::Logits {
            model,
            tokens,
            out,
            mode,
        } => eval_cmd::logits(&cli.config, &model, &tokens, &out, &mode),
        Command::Generate {
            model,
            prompt,
            max_tokens,
            raw,
        } => eval_cmd::generate(&cli.config, &model, &prompt, max_tokens, raw),
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
