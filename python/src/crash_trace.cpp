// python/src/crash_trace.cpp: an opt-in native backtrace on a crash of the extension.
//
// Compiled only when CMake is configured with -DMEGAMOE_PY_CRASH_TRACE=ON (default OFF: release
// builds hold no signal handlers). In such a build, MEGAMOE_CRASH_TRACE=1 in the environment
// (read at import) installs SIGSEGV/SIGBUS/SIGILL/SIGABRT handlers that print each native frame
// as "<object>+0x<offset> <symbol>" to stderr, then re-raise the signal with its default action.
// Python's faulthandler shows only Python frames; this names the native ones (resolve offsets
// with `addr2line -f -C -e <object> 0x<offset>`).
// A diagnostic for crashes seen on one machine only (issue 6), not a production feature.
#include <dlfcn.h>
#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bindings.hpp"

namespace megamoe::python {
namespace {

constexpr int kMaxFrames = 64;
constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGABRT};

void write_str(const char* s) { (void)!write(STDERR_FILENO, s, std::strlen(s)); }

void on_crash(int sig) {
  void* frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  char line[512];
  std::snprintf(line, sizeof(line), "megamoe crash trace: signal %d, %d native frames\n", sig, n);
  write_str(line);
  for (int i = 0; i < n; ++i) {
    Dl_info info{};
    if (dladdr(frames[i], &info) != 0 && info.dli_fname != nullptr) {
      const auto offset = reinterpret_cast<uintptr_t>(frames[i]) -
                          reinterpret_cast<uintptr_t>(info.dli_fbase);
      std::snprintf(line, sizeof(line), "  #%d %s+0x%lx %s\n", i, info.dli_fname,
                    static_cast<unsigned long>(offset), info.dli_sname ? info.dli_sname : "?");
    } else {
      std::snprintf(line, sizeof(line), "  #%d %p\n", i, frames[i]);
    }
    write_str(line);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

void install_crash_trace() {
  const char* v = std::getenv("MEGAMOE_CRASH_TRACE");
  if (v == nullptr || std::strcmp(v, "1") != 0) return;
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  for (const int sig : kSignals) std::signal(sig, on_crash);
}

}  // namespace megamoe::python
