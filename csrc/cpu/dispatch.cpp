// Picks the CPU kernel table for this machine (compiled with baseline flags: it must run anywhere).
#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <string>

#include "kernels.h"

namespace titan::cpu {
namespace {

// 0 = default, 1 = avx2, 2 = avx512: the best level this CPU runs, as ATen sees it (the
// ATEN_CPU_CAPABILITY environment variable lowers it, as for ATen's own kernels).
int machine_level() {
  const std::string cap = at::get_cpu_capability();
  if (cap == "AVX512") return 2;
  if (cap == "AVX2") return 1;
  return 0;
}

const KernelTable* table_for_level(int level) {
#ifdef TITAN_CPU_AVX512
  if (level >= 2) return &AVX512::kTable;
#endif
#ifdef TITAN_CPU_AVX2
  if (level >= 1) return &AVX2::kTable;
#endif
  (void)level;
  return &DEFAULT::kTable;
}

std::atomic<const KernelTable*> g_table{nullptr};

}  // namespace

const KernelTable& kernels() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = table_for_level(machine_level());
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

void set_capability(const char* name) {
  const std::string s = name != nullptr ? name : "";
  if (s == "auto") {
    g_table.store(table_for_level(machine_level()), std::memory_order_release);
    return;
  }
  int level = -1;
  if (s == "default") level = 0;
  if (s == "avx2") level = 1;
  if (s == "avx512") level = 2;
  TORCH_CHECK_VALUE(level >= 0, "capability: expected one of 'auto', 'default', 'avx2', 'avx512', got '", s, "'");
  const KernelTable* t = table_for_level(level);
  TORCH_CHECK_VALUE(std::strcmp(t->name, s.c_str()) == 0, "capability: '", s,
                    "' kernels are not built into this extension (built best: '", table_for_level(2)->name, "')");
  TORCH_CHECK_VALUE(level <= machine_level(), "capability: this CPU does not run '", s, "' (ATen reports '",
                    at::get_cpu_capability(), "')");
  g_table.store(t, std::memory_order_release);
}

const char* capability() { return kernels().name; }

}  // namespace titan::cpu
