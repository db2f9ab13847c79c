#pragma once

// AMX tile configuration and the permission to use the tile state, for the int8 kernel (int8_kernels.h) and the
// AMX experiments (experiments/amx_*.cpp); it includes nothing of torch's.

#include <cstdint>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mvllm {

// ldtilecfg's 64-byte memory operand, palette 1: each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(__AMX_TILE__)
// GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration, so the stores of rows and
// colsb were dropped as dead and ldtilecfg faulted (SIGSEGV) on a Sapphire Rapids host; this asm reads all 64.
inline void load_tile_config(const TileConfig& c) { asm volatile("ldtilecfg %0" : : "m"(c)); }
#endif

#if defined(__linux__) && defined(__x86_64__)
// Linux's permission for this process to use the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
inline bool request_tile_data() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

}  // namespace mvllm
