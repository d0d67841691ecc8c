//! `moeserve`: serve models through an OpenAI-compatible API, and the tools around it.

mod bench_cmd;
mod convert_cmd;
mod dequant_cmd;
mod eval_cmd;
mod model_source;
mod out_path;
mod plugins_cmd;
mod quantize_cmd;
mod serve_cmd;
mod synth_cmd;

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
    /// Prefill (pp) and decode (tg) throughput, measured like llama-bench.
    Bench {
        #[command(flatten)]
        source: model_source::ModelSource,
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 128)]
        gen_tokens: usize,
        #[arg(long, default_value_t = 3)]
        repetitions: usize,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Context depths to measure at, comma-separated (deeper than 0: the slot is
        /// moved there without running the tokens; deepseek4 on a GPU backend).
        #[arg(long, value_delimiter = ',', default_value = "0")]
        depths: Vec<usize>,
        /// Build this many layers from a deepseek4 file with fewer (synthetic models:
        /// each repeated layer is its own copy on the device).
        #[arg(long)]
        layers: Option<usize>,
        /// Also measure the device's streaming bandwidth and ROCmFP2 matrix rate, and
        /// report decode and prefill as fractions of those limits (decode's bandwidth:
        /// the faster of that stream and the backend's device-to-device copy).
        #[arg(long)]
        limits: bool,
        /// Decode in passes of a token and this many drafts, every draft taken (what
        /// speculative decoding reaches at full acceptance; tg counts every token). With
        /// --mtp FILE the MTP block's chain runs before each pass too (its cost counted).
        #[arg(long, default_value_t = 0)]
        draft: usize,
        /// More draft counts to measure the same way at each depth, comma-separated (one
        /// model build for them all; the JSON's `tg_drafted`).
        #[arg(long, value_delimiter = ',')]
        more_drafts: Vec<usize>,
        /// At depths of --long-from or more, prefill passes of this many tokens instead
        /// of --prompt-tokens (serve's bounded prefill: 2048-token chunks on a GPU, 1024
        /// past position 32768); 0: --prompt-tokens at every depth.
        #[arg(long, default_value_t = 0)]
        long_prompt_tokens: usize,
        /// The depth from which --long-prompt-tokens applies.
        #[arg(long, default_value_t = 32768)]
        long_from: usize,
        /// Size the caches for at least this many positions, as `serve --ctx-size` does (a
        /// backend may pick other kernels for a larger cache); 0: just what the deepest
        /// depth, prompt and generated tokens need.
        #[arg(long, default_value_t = 0)]
        ctx_size: usize,
    },
    /// Serve a model through the OpenAI-compatible API.
    Serve(serve_cmd::ServeArgs),
    /// List the loaded plugins, quant formats, devices and placement policies.
    Plugins,
    /// Write float32 logits [T, vocab] for every position of a token sequence (.npy).
    Logits {
        #[command(flatten)]
        source: model_source::ModelSource,
        /// Comma-separated token ids.
        #[arg(long)]
        tokens: String,
        #[arg(long)]
        out: PathBuf,
        /// `prefill` (one batched pass), `decode` (one token at a time, with caches),
        /// `draft` (passes of a token and drafts, some made up and dropped after, as
        /// speculative decoding runs them), or with `--mtp FILE` the drafter's own
        /// logits: `mtp` (each token's guess of the next, the last one's being the first
        /// of a 4-step chain: T + 3 rows), `mtp-prefill` (the chain only, after a one-pass
        /// prefill) or `mtp-draft` (the guess where each `draft` pass starts, NaN rows
        /// elsewhere).
        #[arg(long, default_value = "prefill")]
        mode: String,
        /// Build this many layers from a deepseek4 file with fewer (as `bench --layers`).
        #[arg(long)]
        layers: Option<usize>,
    },
    /// Greedy continuation of a prompt, printed as it is produced.
    Generate {
        #[arg(long)]
        model: PathBuf,
        /// A user message (chat-formatted unless --raw).
        #[arg(long, required_unless_present = "prompt_tokens")]
        prompt: Option<String>,
        /// Comma-separated prompt token ids, used as they are.
        #[arg(long, conflicts_with = "prompt")]
        prompt_tokens: Option<String>,
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Use the prompt as is instead of the model's chat template.
        #[arg(long)]
        raw: bool,
        /// Print generated token ids instead of text.
        #[arg(long)]
        ids: bool,
        /// Positions the cache holds (prompt and generated tokens).
        #[arg(long, default_value_t = 4096)]
        ctx_size: usize,
    },
    /// Decode one tensor to float32 through its quant plugin: write it as .npy, or print
    /// its shape, type and statistics.
    Dequant {
        /// The GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// The tensor's name in the GGUF file.
        #[arg(long)]
        tensor: String,
        /// Write the values here as .npy (numpy shape = the GGUF dims reversed).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Meaning of type 107 for this file when it does not say (`affine` or `two-scale`).
        #[arg(long)]
        fp2: Option<String>,
    },
    /// Convert a DeepSeek-V4 checkpoint (config.json + safetensors) into a deepseek4 GGUF.
    Convert {
        /// The checkpoint directory (transformers' save_pretrained or the release layout).
        dir: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Type of the projection matrices: f32, f16, bf16 or q8_0 (norms, mHC, router and
        /// position biases stay f32; MXFP4 experts stay MXFP4).
        #[arg(long = "type", default_value = "f32")]
        type_name: String,
        /// Pre-tokenizer of the checkpoint's tokenizer.json (default, deepseek-v3, llama3,
        /// qwen2, smollm); needed unless it is a plain ByteLevel one.
        #[arg(long)]
        tokenizer_pre: Option<String>,
        /// Write the checkpoint's next-token-prediction block (`mtp.0.*`) as a drafter file
        /// instead (llama.cpp's `--mtp` layout), for `serve --mtp` / `logits --mtp`.
        #[arg(long)]
        mtp: bool,
    },
    /// Write a DeepSeek-V4-Flash-shaped GGUF with random valid weights of the real type mix
    /// (ROCmFP2 experts, ROCmFP4 attention, Q8_0 embeddings), for runs at real width.
    Synth {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 43)]
        layers: usize,
        #[arg(long, default_value_t = 256)]
        experts: usize,
        #[arg(long, default_value_t = 129280)]
        vocab: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Weight types: `strix-lean` (ROCmFP2 affine experts, ROCmFP4 attention and
        /// shared experts, Q8_0 rest) or `q8_0` (every matrix; llama.cpp loads it too).
        #[arg(long, default_value = "strix-lean")]
        mix: String,
        /// Write the MTP drafter file of that model instead (the same seed and sizes give
        /// the same embedding and head bytes): one sliding-window block as layer LAYERS
        /// with its nextn tensors, as `convert --mtp` lays one out; for `--mtp FILE`.
        #[arg(long)]
        mtp: bool,
    },
    /// Rewrite the tensors whose names match a regex into another quant type; everything
    /// else is copied unchanged.
    Quantize {
        /// The GGUF file to read.
        #[arg(long)]
        model: PathBuf,
        /// The new file (never the input).
        #[arg(long)]
        out: PathBuf,
        /// Regex searched in each tensor name (anchor it with ^...$ for whole names).
        #[arg(long)]
        tensors: String,
        /// Target type: a name as `moeserve plugins` lists it (Q8_0, Q2_0_ROCMFP2, ...), a
        /// type id, or 107-affine / 107-two-scale.
        #[arg(long = "type")]
        type_name: String,
        /// Meaning of type 107 to encode (`affine` or `two-scale`); recorded in the output
        /// as `rocmfpx.fp2_mode`.
        #[arg(long)]
        fp2: Option<String>,
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
        Command::Bench {
            source,
            prompt_tokens,
            gen_tokens,
            repetitions,
            json,
            depths,
            layers,
            limits,
            draft,
            long_prompt_tokens,
            long_from,
            more_drafts,
            ctx_size,
        } => {
            let a = bench_cmd::BenchArgs {
                more_drafts,
                ctx: ctx_size,
                long_prompt: (long_prompt_tokens > 0).then_some((long_from, long_prompt_tokens)),
                prompt_tokens,
                gen_tokens,
                repetitions,
                json,
                depths,
                layers,
                limits,
                draft,
            };
            bench_cmd::run(&cli.config, &source, &a)
        }
        Command::Serve(args) => serve_cmd::run(cli.config, args),
        Command::Logits {
            source,
            tokens,
            out,
            mode,
            layers,
        } => eval_cmd::logits(&cli.config, &source, &tokens, &out, &mode, layers),
        Command::Generate {
            model,
            prompt,
            prompt_tokens,
            max_tokens,
            raw,
            ids,
            ctx_size,
        } => {
            let a = eval_cmd::GenerateArgs {
                prompt,
                prompt_tokens,
                max_tokens,
                raw,
                ids,
                ctx_size,
            };
            eval_cmd::generate(&cli.config, &model, &a)
        }
        Command::Dequant {
            model,
            tensor,
            out,
            fp2,
        } => {
            let a = dequant_cmd::DequantArgs {
                model,
                tensor,
                out,
                fp2,
            };
            dequant_cmd::run(&cli.config, &a)
        }
        Command::Synth {
            out,
            layers,
            experts,
            vocab,
            seed,
            mix,
            mtp,
        } => synth_cmd::run(&out, layers, experts, vocab, seed, &mix, mtp),
        Command::Convert {
            dir,
            out,
            type_name,
            tokenizer_pre,
            mtp,
        } => convert_cmd::run(
            &cli.config,
            &dir,
            &out,
            &type_name,
            tokenizer_pre.as_deref(),
            mtp,
        ),
        Command::Quantize {
            model,
            out,
            tensors,
            type_name,
            fp2,
        } => {
            let a = quantize_cmd::QuantizeArgs {
                model,
                out,
                tensors,
                type_name,
                fp2,
            };
            quantize_cmd::run(&cli.config, &a)
        }
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
