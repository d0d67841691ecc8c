//! MOE_ROUTED (ABI 1.13): one token's router and routed experts as one op. Where the
//! backend launches cooperatively and the three ops it stands for would each take their
//! one-token kernels (`ds4_router_mm`, `mmvq_id_107` on xq for gate + up, then
//! `quantize_q8_1_swiglu` + `mmvq_id_107` for down), it runs them as one launch,
//! `ds4_moe_routed` (kernels/gpu/ds4.cu), whose stages meet at grid barriers instead of
//! kernel boundaries: the same warps, so the same bits. Elsewhere it runs the three ops.

use moe_plugin_api::{ops, types, OpParams, TensorRef};

use crate::ops::{
    id_rows, matmul_dense, matmul_id, matmul_id_multi, run as run_op, xq_fits, DenseLayout, Gpu,
    IdMultiStep, MatmulId, Q8_BYTES,
};

/// Blocks a multiprocessor of `ds4_moe_routed`: 2 (DS4_MOER_BLOCKS_PER_SM, its launch
/// bounds' minimum), or `MOE_GPU_MOER_BLOCKS=1` (A/B runs; read once).
pub fn blocks_per_sm() -> u32 {
    static N: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *N.get_or_init(|| match crate::ops::env_num::<u32>("MOE_GPU_MOER_BLOCKS") {
        Some(1) => 1,
        _ => 2,
    })
}

/// `MOE_GPU_MOER_Q8=block`: each `ds4_moe_routed` block of the down product quantises
/// its expert's SwiGLU itself, with no stage and barrier of their own (A/B runs; read
/// once).
pub fn q8_local() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MOE_GPU_MOER_Q8").is_some_and(|v| v == "block"))
}

/// `MOE_GPU_MOER_PF`: what `ds4_moe_routed` asks L2 for ahead of its loads (A/B runs;
/// read once): `1` all the chosen experts' down rows as soon as it has chosen them; `2`
/// each warp its next task's rows before it sums the current one's; else nothing (0).
pub fn prefetch_mode() -> i32 {
    static MODE: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        crate::ops::env_num::<i32>("MOE_GPU_MOER_PF")
            .filter(|m| matches!(m, 1 | 2))
            .unwrap_or(0)
    })
}

/// MOE_ROUTED's arguments by role.
struct Args<'a> {
    router: &'a [TensorRef],
    xq: TensorRef,
    /// gate w, gate out, up w, up out
    gate_up: &'a [TensorRef],
    down: TensorRef,
    out: TensorRef,
    act: TensorRef,
    sync: TensorRef,
}

fn split(args: &[TensorRef]) -> Result<Args<'_>, String> {
    if args.len() != ops::MOE_ROUTED_ARGS {
        return Err(format!(
            "moe_routed: expected {} tensor arguments (ROUTER's nine, xq, gate w / out, up w \
             / out, down w / out, act, sync), got {}",
            ops::MOE_ROUTED_ARGS,
            args.len()
        ));
    }
    Ok(Args {
        router: &args[..ops::ROUTER_MM_ARGS],
        xq: args[9],
        gate_up: &args[10..14],
        down: args[14],
        out: args[15],
        act: args[16],
        sync: args[17],
    })
}

/// `MOE_GPU_MOE_ROUTED=0` runs the three ops even where the one launch could (A/B runs;
/// read once).
fn fused_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_MOE_ROUTED"))
}

/// The one launch's plan: gate + up as one `mmvq_id_107` pair on xq, down on their
/// SwiGLU, 4 rows a warp, all for one token.
struct Fused {
    gate_up: Box<MatmulId>,
    w_step: i64,
    out_step: i64,
    down: MatmulId,
}

/// Runs MOE_ROUTED: the one launch where [`fused_plan`] finds one, else ROUTER,
/// MATMUL_ID_MULTI and SWIGLU_MATMUL_ID.
pub fn run(
    gpu: &impl Gpu,
    backend: &str,
    mmq: &'static str,
    params: &OpParams,
    args: &[TensorRef],
) -> Result<(), String> {
    let a = split(args)?;
    let (x, ids) = (a.router[6], a.router[4]);
    let (g, u) = (a.gate_up[1], a.gate_up[3]);
    if let Some(plan) = fused_plan(gpu, mmq, &a)? {
        // Every argument checked: the router's by router_mm, the products' by matmul_id.
        let launch = crate::ds4::moe_routed(
            gpu,
            params,
            a.router,
            &plan.gate_up,
            (plan.w_step, plan.out_step),
            gpu.ptr(&a.xq, 4)?,
            &plan.down,
            gpu.scratch(moe_act_bytes(&plan.down))?,
            gpu.ptr(&a.sync, 4)?,
        )?;
        // SAFETY: see above; the scratch holds the SwiGLU's q8_1 blocks.
        return unsafe { launch.launch(gpu) };
    }
    let mut rp = OpParams::default();
    rp.f[0] = params.f[0];
    rp.i[..3].copy_from_slice(&params.i[..3]);
    run_op(gpu, backend, mmq, ops::ROUTER, &rp, a.router)?;
    let mut mp = OpParams::default();
    mp.i[0] = 1;
    let mut multi = vec![x, ids, a.xq];
    multi.extend_from_slice(a.gate_up);
    run_op(gpu, backend, mmq, ops::MATMUL_ID_MULTI, &mp, &multi)?;
    let mut sp = OpParams::default();
    sp.f[0] = params.f[1];
    let down = [a.down, g, u, ids, a.out, a.act];
    run_op(gpu, backend, mmq, ops::SWIGLU_MATMUL_ID, &sp, &down)
}

/// Bytes of the SwiGLU's q8_1 blocks (one a pair's 32 values).
fn moe_act_bytes(down: &MatmulId) -> usize {
    (down.pairs as u64 * down.k / 32 * Q8_BYTES) as usize
}

/// The one launch's plan, where the backend launches it cooperatively, it is not turned
/// off, and each of the three ops would take its one-token kernel: ROUTER's product on
/// `matvec_f32_wide` (so `ds4_router_mm`), gate and up a `mmvq_id_107` pair reading xq,
/// down `mmvq_id_107` on a column a pair, 4 rows a warp throughout. None elsewhere;
/// errors for arguments the three ops would refuse too.
fn fused_plan(gpu: &impl Gpu, mmq: &'static str, a: &Args) -> Result<Option<Fused>, String> {
    if !gpu.grid_sync()
        || fused_off()
        || crate::ops::router_mm_off()
        || gpu.multiprocessors() == 0
        || id_rows() != 4
    {
        return Ok(None);
    }
    let (logits, x, wr) = (a.router[0], a.router[6], a.router[7]);
    let e = logits.dims[0];
    if logits.numel() != e {
        return Ok(None); // more than one token
    }
    let product = matmul_dense(&[wr, x, logits], mmq, |t, al| gpu.ptr(t, al))?;
    if !product.is_some_and(|p| p.layout == DenseLayout::F32Wide) {
        return Ok(None);
    }
    let ids = a.router[4];
    let mut multi = vec![x, ids];
    multi.extend_from_slice(a.gate_up);
    let mut ptr = |t: &TensorRef, al: u64| gpu.ptr(t, al);
    let mut steps = matmul_id_multi(&multi, mmq, &mut ptr)?;
    let (plan, w_step, out_step) = match (steps.pop(), steps.is_empty()) {
        (
            Some(IdMultiStep::Pair {
                plan,
                w_step,
                out_step,
                ..
            }),
            true,
        ) => (plan, w_step, out_step),
        _ => return Ok(None),
    };
    let (g, u) = (a.gate_up[1], a.gate_up[3]);
    if plan.grouped.name != "mmvq_id_107"
        || a.xq.type_id != types::I32
        || !xq_fits(&a.xq, &plan)
        || u.dims != g.dims
        || a.act.dims != g.dims
    {
        return Ok(None);
    }
    let down = matmul_id(&[a.down, g, ids, a.out], mmq, &mut ptr)?;
    if down.grouped.name != "mmvq_id_107"
        || down.per_pair != 1
        || down.k != plan.m as u64
        || down.m as u64 != plan.k
        || down.experts != plan.experts
        || plan.experts as u64 != e
        || down.x != plan.out
        || gpu.ptr(&u, 4)? != plan.out.wrapping_add(out_step as u64)
        || g.type_id != types::F32
        || u.type_id != types::F32
    {
        return Ok(None);
    }
    crate::ops::expect(&a.sync, types::I32, "moe_routed sync")?;
    Ok(Some(Fused {
        gate_up: plan,
        w_step,
        out_step,
        down,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ds4::tests::Rec, kernels::signatures, ops::tests::t};

    /// V4-Flash's MoE for one token: 4096 wide, 6 of 256 experts of 2048.
    fn args(e: u64) -> Vec<TensorRef> {
        let (d, ff, k) = (4096, 2048, 6);
        let f = |dims| t(types::F32, dims);
        let i = |n| t(types::I32, [n, 1, 1, 1]);
        let w = |k, m| t(crate::ops::TYPE_Q2_0_ROCMFP2, [k, m, e, 1]);
        vec![
            f([e, 1, 1, 1]),
            f([e, 1, 1, 1]),
            i(1),
            i(1),
            i(k),
            f([k, 1, 1, 1]),
            f([d, 1, 1, 1]),
            f([d, e, 1, 1]),
            i(1),
            i(d / 32 * 10),
            w(d, ff),
            f([ff, k, 1, 1]),
            w(d, ff),
            f([ff, k, 1, 1]),
            w(ff, d),
            f([d, k, 1, 1]),
            f([ff, k, 1, 1]),
            i(1),
        ]
    }

    fn launched(g: Rec, a: &[TensorRef]) -> Vec<(&'static str, (u32, u32, u32))> {
        let mut p = OpParams::default();
        p.f[..2].copy_from_slice(&[2.5, 10.0]);
        p.i[..3].copy_from_slice(&[4, 1, 1]);
        run(&g, "test", "mmq_mma_107", &p, a).unwrap();
        let sig = signatures();
        let l = g.0.into_inner();
        for &(name, _, _, n) in &l {
            assert_eq!(
                Some(&(n + 1)),
                sig.get(name),
                "{name}: arguments vs signature"
            );
        }
        l.into_iter().map(|(n, grid, _, _)| (n, grid)).collect()
    }

    #[test]
    fn one_launch_where_cooperative_else_the_three_ops() {
        let fused = launched(Rec::grid_synced(132, true), &args(256));
        assert_eq!(fused, [("ds4_moe_routed", (2 * 132, 1, 1))]);
        let names: Vec<&str> = launched(Rec::grid_synced(132, false), &args(256))
            .into_iter()
            .map(|l| l.0)
            .collect();
        assert_eq!(
            names,
            [
                "ds4_router_mm",
                "mmvq_id_107",
                "quantize_q8_1_swiglu",
                "mmvq_id_107"
            ]
        );
        // An xq too small for x's blocks: gate and up quantise x themselves, so no one
        // launch.
        let mut short = args(256);
        short[9].dims[0] = 1;
        let names: Vec<&str> = launched(Rec::grid_synced(132, true), &short)
            .into_iter()
            .map(|l| l.0)
            .collect();
        assert_eq!(names[..2], ["ds4_router_mm", "quantize_q8_1"]);
        let mut bad = args(256);
        bad.pop();
        let mut p = OpParams::default();
        p.i[0] = 4;
        let e = run(
            &Rec::grid_synced(132, false),
            "test",
            "mmq_mma_107",
            &p,
            &bad,
        )
        .unwrap_err();
        assert!(e.contains("expected 18 tensor arguments"), "{e}");
    }
}
