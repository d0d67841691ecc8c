//! The engine: models as graphs of backend ops, sampling, and the scheduler that
//! batches concurrent requests into shared forward passes.

pub mod deepseek4;
pub mod device;
pub mod llama;
pub mod model;
pub mod npy;
pub mod sampling;
pub mod scheduler;

pub use model::{
    load, load_gguf, open_gguf_bytes, BatchEntry, CausalLm, LoadOptions, LoadedModel, StepTraffic,
};
pub use sampling::{Sampled, SamplingParams};
pub use scheduler::{
    Emitted, Event, FinishReason, GenRequest, Scheduler, SchedulerOptions, Stats, SubmitError,
    Timings,
};
