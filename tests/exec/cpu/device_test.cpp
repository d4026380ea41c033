#include "exec/cpu/device.hpp"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>

#include "exec/cpu/bf16_device.hpp"

using dtsim::exec::Dtype;
using dtsim::exec::View;
using dtsim::exec::cpu::CpuDevice;

namespace {

float at(View v, std::int64_t i) {
  return static_cast<const float*>(v.p)[i];
}

}  // namespace

// A tensor for overwrite holds NaN until written (so that a kernel reading it first shows in
// the loss), new or taken from a released buffer; allocate's hold zeros, whatever was there.
TEST_CASE("CPU device: tensors for overwrite are poisoned, others zero", "[exec][cpu]") {
  CpuDevice dev(/*poison_unwritten=*/true);
  const View fresh = dev.allocate_for_overwrite(1000, Dtype::F32);
  CHECK(std::isnan(at(fresh, 0)));
  CHECK(std::isnan(at(fresh, 999)));
  for (std::int64_t i = 0; i < 1000; ++i) static_cast<float*>(fresh.p)[i] = 1.5f;
  dev.release(fresh);
  const View zeros = dev.allocate(1000, Dtype::F32);  // the released buffer again
  CHECK(zeros.p == fresh.p);
  CHECK(at(zeros, 0) == 0.0f);
  CHECK(at(zeros, 999) == 0.0f);
  for (std::int64_t i = 0; i < 1000; ++i) static_cast<float*>(zeros.p)[i] = 2.5f;
  dev.release(zeros);
  const View reused = dev.allocate_for_overwrite(900, Dtype::F32);
  CHECK(reused.p == fresh.p);
  CHECK(std::isnan(at(reused, 0)));
  CHECK(std::isnan(at(reused, 899)));
  // Integers read -1, a mask's bytes 255.
  const View ints = dev.allocate_for_overwrite(3, Dtype::I32);
  CHECK(static_cast<const int*>(ints.p)[2] == -1);
  const View mask = dev.allocate_for_overwrite(5, Dtype::U8);
  CHECK(static_cast<const unsigned char*>(mask.p)[4] == 255);
  dev.release(reused);
  dev.release(ints);
  dev.release(mask);
}

// Without the poison (runs, benchmarks) a tensor for overwrite holds what its buffer held: no
// pass over it. allocate's hold zeros all the same.
TEST_CASE("CPU device: tensors for overwrite are not filled without the poison", "[exec][cpu]") {
  CpuDevice dev(/*poison_unwritten=*/false);
  const View first = dev.allocate_for_overwrite(1000, Dtype::F32);
  for (std::int64_t i = 0; i < 1000; ++i) static_cast<float*>(first.p)[i] = 1.5f;
  dev.release(first);
  const View again = dev.allocate_for_overwrite(1000, Dtype::F32);
  REQUIRE(again.p == first.p);
  CHECK(at(again, 0) == 1.5f);
  CHECK(at(again, 999) == 1.5f);
  dev.release(again);
  const View zeros = dev.allocate(1000, Dtype::F32);
  CHECK(at(zeros, 0) == 0.0f);
  CHECK(at(zeros, 999) == 0.0f);
  dev.release(zeros);
}

// The bf16 emulation's tensors (two to a word of the CPU device): NaN in both halves (its CPU
// device takes the poison from the environment, as the tests set it).
TEST_CASE("bf16 device: tensors for overwrite are poisoned in both halves", "[exec][cpu]") {
  REQUIRE(dtsim::exec::Device::poison_unwritten_from_env());
  dtsim::exec::cpu::Bf16Device dev;
  const View v = dev.allocate_for_overwrite(3, Dtype::BF16);
  std::uint16_t halves[3];
  std::memcpy(halves, v.p, sizeof halves);
  for (const std::uint16_t h : halves) {
    CHECK((h & 0x7f80) == 0x7f80);  // exponent all ones
    CHECK((h & 0x007f) != 0);       // and a mantissa: NaN, not infinity
  }
  dev.release(v);
}
