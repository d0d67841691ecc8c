//! Host-side logic shared by the CUDA and HIP backends (both run the same
//! `kernels/gpu` sources): op argument and shape validation, scratch-buffer layout and
//! launch sizing ([`ops`]), and the kernel list, source assembly, cache key and path
//! and launch counting ([`kernels`]). Nothing here touches a GPU: the backends keep
//! only their allocation and launch calls.

pub mod ds4;
pub mod kernels;
pub mod moe_routed;
pub mod ops;

/// Builds the `void**` argument list of a kernel launch from local variables.
#[macro_export]
macro_rules! kargs {
    ($($v:ident),* $(,)?) => {
        [$(&mut $v as *mut _ as *mut ::std::ffi::c_void),*]
    };
}
