// test_util.hpp: helpers every CPU test file may use.
//
// - throws_error(fn, code, parts): an AssertionResult; fn must throw megamoe::Error with exactly
//   this code and a message containing every one of `parts`.
// - expect_error(fn, code, fragment): the same as a non-fatal expectation with one fragment (the
//   specific error, not "some error").
// - run_cli(args): runs the built `megamoe` program with stdout and stderr merged.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "megamoe/error.hpp"

namespace megamoe::test {

inline ::testing::AssertionResult throws_error(const std::function<void()>& fn, ErrorCode code,
                                               const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    if (e.code() != code) {
      return ::testing::AssertionFailure() << "error code " << error_code_name(e.code())
                                           << " instead of " << error_code_name(code) << ": "
                                           << e.what();
    }
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks \"" << p << "\": " << msg;
      }
    }
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "non-megamoe exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "no exception (expected " << error_code_name(code)
                                       << ")";
}

template <typename F>
void expect_error(F&& fn, ErrorCode code, const std::string& fragment) {
  EXPECT_TRUE(throws_error(std::forward<F>(fn), code, {fragment}));
}

// The `megamoe` program of this build (MEGAMOE_BINARY_DIR is set by tests/CMakeLists.txt).
inline const std::string& cli_path() {
  static const std::string path = std::string(MEGAMOE_BINARY_DIR) + "/megamoe";
  return path;
}

struct CliResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

inline CliResult run_cli(const std::string& args) {
  CliResult r;
  const std::string cmd = cli_path() + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace megamoe::test
