// Bad options to the `megamoe` program (docs/reliability.md, rows C*): each one runs the built
// binary and checks the exit code and the specific message on stderr, and that nothing was
// printed on stdout as if a run had happened.
//
// Exit codes: 0 ok; 1 a megamoe::Error (stderr "megamoe <cmd>: error (<code>): <message>");
// 3 a requested check failed; CLI11's own codes for parse errors (106 a required subcommand is
// missing, 104 a value does not convert, 109 an unexpected argument, 114 a value is missing).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace {

constexpr int kExitError = 1;
constexpr int kExitCheckFailed = 3;
constexpr int kCli11RequiredError = 106;
constexpr int kCli11ConversionError = 104;
constexpr int kCli11ValidationError = 105;  // CLI::ValidationError
constexpr int kCli11ExtrasError = 109;
constexpr int kCli11ArgumentMismatch = 114;

using megamoe::test::cli_path;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Result {
  int code = -1;
  std::string out, err;
};

Result run_cli(const std::string& args) {
  char dir_template[] = "/tmp/megamoe_cli_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  EXPECT_NE(dir, nullptr);
  const std::string out = std::string(dir) + "/out", err = std::string(dir) + "/err";
  const std::string cmd = cli_path() + " " + args + " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  std::remove(out.c_str());
  std::remove(err.c_str());
  rmdir(dir);
  return r;
}

struct BadOption {
  const char* args;
  int code;
  const char* fragment;  // expected in stderr
};

class ReliabilityCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(access(cli_path().c_str(), X_OK), 0)
        << cli_path() << " is missing: build the megamoe target (ninja megamoe_cli) before the tests";
  }
};

TEST_F(ReliabilityCli, BadOptionsExitWithTheSpecificError) {
  const BadOption cases[] = {
      // C1-C4: the parser.
      {"", kCli11RequiredError, "A subcommand is required"},
      {"frobnicate", kCli11RequiredError, "A subcommand is required"},
      {"run --bogus", kCli11ExtrasError, "The following argument was not expected: --bogus"},
      {"run --tokens abc", kCli11ConversionError, "Could not convert: --tokens = abc"},
      {"run --tokens", kCli11ArgumentMismatch, "--tokens: 1 required INT missing"},
      {"run --hidden 1.5", kCli11ConversionError, "Could not convert: --hidden = 1.5"},
      // C5-C20: values the parser accepts and megamoe rejects (exit 1, typed error).
      {"run --shape nope", kExitError,
       "error (invalid argument): shape: unknown preset 'nope' (expected one of kimi-k3"},
      {"run --tokens -1", kExitError, "error (invalid argument): --tokens must be >= 0, got -1"},
      {"run --activation gelu", kExitError, "activation 'gelu': unknown name 'gelu'"},
      {"run --activation situ:clamp=7", kExitError, "situ takes no clamp"},
      {"run --activation situ:beta=0", kExitError, "beta must be finite and > 0, got 0"},
      {"run --activation swiglu:clamp=-2", kExitError, "clamp must be finite and >= 0, got -2"},
      {"run --activation situ:beta=nan", kExitError, "beta must be finite and > 0, got nan"},
      {"run --backend tpu", kExitError, "error (invalid argument): MoeLayer: unknown backend 'tpu'"},
      {"run --hidden 1000", kExitError, "hidden (H) must be a positive multiple of 32, got 1000"},
      {"run --intermediate 100", kExitError, "intermediate (I) must be a positive multiple of 32, got 100"},
      {"run --experts -4", kExitError, "num_experts (E) must be > 0, got -4"},
      {"run --top-k 64", kExitError, "top_k (K) must be in [1, E=32], got 64"},
      {"run --ep-size 3", kExitError, "ep_size 3 must divide num_experts 32"},
      {"run --ep-size 2 --ep-rank 2", kExitError, "ep_rank must be in [0, ep_size=2), got 2"},
      {"run --tokens 8 --capacity 4", kExitError, "error (out of range)"},
      {"run --routing zipf", kExitError, "routing: unknown kind 'zipf'"},
      {"run --bias maybe", kExitError, "--bias: expected auto, on or off, got 'maybe'"},
      {"run --iters 0", kExitError, "--iters must be >= 1"},
      {"run --warmup -1", kExitError, "--warmup >= 0"},
      // C11-C12: sizes and numbers that used to reach the allocator or wrap around.
      {"run --tokens 99999999999999", kExitError,
       "--tokens and --capacity must be <= 16777216, got 99999999999999"},
      {"run --threads -3", kExitError, "--threads must be in [0, 1048576] (0 = all cores), got -3"},
      {"run --max-diff nan", kCli11ValidationError, "--max-diff: must be a finite number >= 0, got 'nan'"},
      {"run --seed -1", kCli11ValidationError, "--seed: must be an unsigned integer, got '-1'"},
  };
  for (const BadOption& c : cases) {
    SCOPED_TRACE(std::string("megamoe ") + c.args);
    const Result r = run_cli(c.args);
    EXPECT_EQ(r.code, c.code) << "stderr: " << r.err;
    EXPECT_NE(r.err.find(c.fragment), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(r.out.find("megamoe run\n"), std::string::npos) << "stdout: " << r.out;
  }
}

// C9-C10: checkpoint commands (inspect, prepare): a missing file is an I/O error, a file that is
// not safetensors a format error naming it; required arguments are enforced by the parser. The
// malformed-content cases themselves are the checkpoint table (tests/cpp/test_safetensors.cpp).
TEST_F(ReliabilityCli, CheckpointCommandsReportBadFiles) {
  char dir_template[] = "/tmp/megamoe_cli_ckpt_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string truncated = dir + "/truncated.safetensors";
  std::ofstream(truncated) << "abc";
  const std::string missing = dir + "/missing.safetensors";
  const BadOption cases[] = {
      {"inspect", kCli11RequiredError, "checkpoint is required"},
      {"prepare CKPT --backend sm90", kCli11RequiredError, "--output is required"},
      {"inspect MISSING", kExitError, "megamoe inspect: error (I/O error): MISSING: cannot open"},
      {"inspect CKPT", kExitError,
       "megamoe inspect: error (format error): CKPT: truncated file: 3 bytes, fewer than the "
       "8-byte header length"},
      {"prepare MISSING --backend sm90 -o OUT", kExitError, "error (I/O error): MISSING: cannot open"},
      {"prepare CKPT --backend tpu -o OUT", kExitError, "error (format error): CKPT: truncated file"},
  };
  auto expand = [&](std::string s) {
    for (const auto& [key, value] : {std::pair<std::string, std::string>{"CKPT", truncated},
                                     {"MISSING", missing}, {"OUT", dir + "/out.safetensors"}}) {
      for (size_t at; (at = s.find(key)) != std::string::npos;) s.replace(at, key.size(), value);
    }
    return s;
  };
  for (const BadOption& c : cases) {
    const std::string args = expand(c.args);
    SCOPED_TRACE("megamoe " + args);
    const Result r = run_cli(args);
    EXPECT_EQ(r.code, c.code) << "stderr: " << r.err;
    EXPECT_NE(r.err.find(expand(c.fragment)), std::string::npos) << "stderr: " << r.err;
  }
  EXPECT_NE(access((dir + "/out.safetensors").c_str(), F_OK), 0) << "a failed prepare left output";
  std::remove(truncated.c_str());
  rmdir(dir.c_str());
}

// C21: a backend this build or machine cannot run is "unsupported", not "invalid".
TEST_F(ReliabilityCli, UnavailableBackendIsUnsupported) {
  const Result r = run_cli("run --backend sm90 --tokens 1");
  if (r.code == 0) {
    EXPECT_NE(r.out.find("backend     sm90"), std::string::npos) << r.out;  // a GPU machine
    return;
  }
  EXPECT_EQ(r.code, kExitError) << r.err;
  EXPECT_NE(r.err.find("error (unsupported): backend sm90 cannot run here"), std::string::npos)
      << r.err;
}

// C22: an accuracy limit that fails is exit 3 with FAIL printed, not an error.
TEST_F(ReliabilityCli, FailedCheckIsExitThree) {
  const Result r = run_cli("run --tokens 2 --max-diff 0");
  EXPECT_EQ(r.code, kExitCheckFailed) << r.err;
  EXPECT_NE(r.out.find("FAIL"), std::string::npos) << r.out;
  // And --help works and lists the options of each rejected case above.
  const Result h = run_cli("run --help");
  EXPECT_EQ(h.code, 0);
  for (const char* opt : {"--shape", "--tokens", "--activation", "--backend", "--capacity",
                          "--ep-size", "--ep-rank", "--routing", "--bias"})
    EXPECT_NE(h.out.find(opt), std::string::npos) << opt;
}

}  // namespace
