//! A stand-in for what MLX 0.32.4 puts before a custom kernel (its device header), so that
//! turboquant.kernels.cuda.translation_unit compiles offline with nvcc where no GPU is present.
//@@ prelude
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cstdint>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}

//! What cubin_cache hands NVRTC as MLX's device header: the includes of MLX 0.32.4's utils.cuh
//! that our kernels rely on (NVRTC has no <cstdint>) and the same Shape and Strides types.
//@@ nvrtc
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
