// A GPU as a Device (exec/core/device.hpp) for the Program runner: activations in bf16 (or
// fp32), fp32 master weights, gradients and AdamW state, the kernels of exec/cuda/kernels.hpp on
// one stream, and a pool of released device buffers that later tensors reuse. Plain C++: no
// CUDA type in this interface.
#pragma once

#include <memory>

#include "exec/core/device.hpp"

namespace dtsim::exec::cuda {

// The device of GPU `gpu` with activations of `activations` (Dtype::BF16 or Dtype::F32).
// Throws CudaError when the GPU cannot be used.
std::unique_ptr<Device> make_device(int gpu, Dtype activations);

// The stream (a cudaStream_t) on which a device made by make_device queues its work, and the
// GPU it is bound to. InternalError for another kind of device.
void* stream_of(Device& device);
int gpu_of(const Device& device);

// A mark (Device::mark's numbering, elapsed() between any two) recorded on `stream`, another
// stream of the device's GPU (a cudaStream_t): where a collective queued there has got to.
int mark_on(Device& device, void* stream);

}  // namespace dtsim::exec::cuda
