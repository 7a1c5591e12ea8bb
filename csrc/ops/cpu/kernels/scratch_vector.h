// Scratch buffers that the kernels write before they read: a std::vector whose sizing
// constructor and resize leave trivially constructible elements (float, bfloat16, int64) as they
// find them instead of zeroing them. A short call touches little more than its scratch: zeroing
// the forward's (the scores, their last chain and the tile's output rows, about 90 KB at 64 x 128
// blocks) and the heap's frees behind it took a fifth of a one-head L 64 bfloat16 forward's
// samples on an AMX Xeon.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

// std::allocator, but for constructing an element with no arguments: default-initialization,
// which leaves a trivially constructible element unwritten (value-initialization zeroes it); and
// each buffer on a cache line of its own, as at::empty's are, so that the block products' operand
// rows start on a line (on std::allocator's 16-byte boundaries, a bfloat16 forward+backward took
// 1.1x as long on an AMX Xeon).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  static constexpr std::align_val_t kAlignment{64};
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, kAlignment); }

  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using ScratchVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace causal_attention::cpu::CPU_CAPABILITY
