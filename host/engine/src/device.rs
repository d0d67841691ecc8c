//! A safe face on a backend plugin's function table: owned buffers, typed tensors,
//! and op calls whose errors carry context.

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use moe_plugin_api::{into_result, types, Backend, DeviceInfo, OpParams, TensorRef};

/// One device of one backend, with its stream.
pub struct Device {
    be: Backend,
    pub index: u32,
    stream: u64,
}

impl Device {
    pub fn open(be: &Backend, index: u32) -> Result<Arc<Device>> {
        let stream = into_result((be.stream_create)(index))
            .map_err(|e| anyhow!("{} device {index}: cannot create a stream: {e}", be.name))?;
        Ok(Arc::new(Device {
            be: be.clone(),
            index,
            stream,
        }))
    }

    pub fn name(&self) -> String {
        format!("{}:{}", self.be.name, self.index)
    }

    /// The backend's own name for this device (its `DeviceInfo` name, e.g. the CPU
    /// backend's "<model> (N threads)"), or [`Device::name`] when it lists no such device.
    pub fn description(&self) -> String {
        self.info()
            .map(|d| d.name.to_string())
            .unwrap_or_else(|| self.name())
    }

    /// What the backend says of this device (`DeviceInfo`), if it lists it.
    pub fn info(&self) -> Option<DeviceInfo> {
        into_result((self.be.devices)())
            .ok()
            .and_then(|v| v.into_iter().find(|d| d.index == self.index))
    }

    /// A new zeroed tensor.
    pub fn tensor(self: &Arc<Self>, type_id: u32, dims: [u64; 4], bytes: u64) -> Result<Tensor> {
        let buffer = into_result((self.be.alloc)(self.index, bytes))
            .map_err(|e| anyhow!("{}: allocating {bytes} bytes: {e}", self.name()))?;
        Ok(Tensor {
            dev: self.clone(),
            r: TensorRef {
                buffer,
                offset: 0,
                type_id,
                variant: 0,
                dims,
            },
            bytes,
        })
    }

    pub fn f32(self: &Arc<Self>, dims: [u64; 4]) -> Result<Tensor> {
        self.tensor(types::F32, dims, dims.iter().product::<u64>() * 4)
    }

    pub fn i32(self: &Arc<Self>, n: usize) -> Result<Tensor> {
        self.tensor(types::I32, [n as u64, 1, 1, 1], n as u64 * 4)
    }

    pub fn op(&self, op: u32, params: OpParams, args: &[TensorRef]) -> Result<()> {
        into_result((self.be.run_op)(self.stream, op, params, args.into()))
            .map_err(|e| anyhow!("{} op {op}: {e}", self.name()))
    }

    /// Another stream on this device: its ops run concurrently with this one's, ordered
    /// against them only by [`Device::wait_for`].
    pub fn another_stream(&self) -> Result<Arc<Device>> {
        Device::open(&self.be, self.index)
    }

    /// Ops queued on this stream from now on wait for every op queued so far on
    /// `other` (a fork or a join of two streams; recorded into a graph under capture).
    pub fn wait_for(&self, other: &Device) -> Result<()> {
        let ev = into_result((self.be.event_record)(other.stream))
            .map_err(|e| anyhow!("{}: recording an event: {e}", other.name()))?;
        into_result((self.be.stream_wait_event)(self.stream, ev))
            .map_err(|e| anyhow!("{}: waiting for an event: {e}", self.name()))
    }

    pub fn sync(&self) -> Result<()> {
        into_result((self.be.synchronize)(self.stream)).map_err(|e| anyhow!("{}: {e}", self.name()))
    }

    pub fn counters(&self) -> Vec<(String, u64)> {
        (self.be.kernel_counters)()
            .into_iter()
            .map(|t| (t.0.into_string(), t.1))
            .collect()
    }
}

/// A buffer owned by the host side, freed (by the backend that made it) on drop.
pub struct Tensor {
    dev: Arc<Device>,
    pub r: TensorRef,
    pub bytes: u64,
}

impl Tensor {
    /// The same buffer seen with other dims (and count of values).
    pub fn view(&self, dims: [u64; 4]) -> TensorRef {
        TensorRef { dims, ..self.r }
    }

    pub fn upload(&self, data: &[u8]) -> Result<()> {
        into_result((self.dev.be.upload)(self.r.buffer, 0, data.into()))
            .map_err(|e| anyhow!("{}: upload: {e}", self.dev.name()))
    }

    pub fn upload_i32(&self, v: &[i32]) -> Result<()> {
        self.upload(bytemuck::cast_slice(v))
    }

    pub fn upload_f32(&self, v: &[f32]) -> Result<()> {
        self.upload(bytemuck::cast_slice(v))
    }

    /// Reads `n` f32 values from the start of the buffer (straight into the result: a
    /// decode step's logits are 0.5 MB at V4's vocabulary).
    pub fn download_f32(&self, n: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; n];
        into_result((self.dev.be.download)(
            self.r.buffer,
            0,
            bytemuck::cast_slice_mut::<f32, u8>(&mut out).into(),
        ))
        .map_err(|e| anyhow!("{}: download: {e}", self.dev.name()))
        .context("reading results back")?;
        Ok(out)
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Err(e) = into_result((self.dev.be.free)(self.r.buffer)) {
            tracing::warn!("{}: freeing a buffer: {e}", self.dev.name());
        }
    }
}
