// The `megamoe` program as a user runs it: the built binary, its output and exit codes.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "test_util.hpp"

namespace {

using megamoe::test::cli_path;
using megamoe::test::run_cli;
using megamoe::test::CliResult;

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(cli_path()))
        << cli_path() << " is missing: build the megamoe_cli target (ninja builds it by default)";
  }
};

TEST_F(Cli, SyntheticRunPrintsWhatItRanAndPasses) {
  const CliResult r = run_cli("run --tokens 64");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* fragment :
       {"shape       small: H=1024 I=512 E=32 K=4", "activation  swiglu", "tokens      64, routing uniform, seed 0",
        "fast_math on", "ms median", "vs the FP64 ideal MoE", "worst row", "worst expert", "result      PASS"})
    EXPECT_NE(r.output.find(fragment), std::string::npos) << "missing '" << fragment << "' in:\n" << r.output;
  EXPECT_TRUE(r.output.find("backend     cpu") != std::string::npos ||
              r.output.find("backend     sm90") != std::string::npos)
      << r.output;
}

// `megamoe run` with no option is the README's main job: the example model answering problems.
// (Its own suite so the sanitizer run, which leaves the model's 200-problem decodes out, can
// name it: tests/sanitize.sh.)
class ModelCli : public Cli {};

TEST_F(ModelCli, RunWithoutOptionsAnswersProblemsAndPassesTheGate) {
  const CliResult r = run_cli("run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* fragment : {"megamoe model:", "Q: ", "A: ", "correct (expected", "accuracy  ",
                               "gate 0.95: PASS"})
    EXPECT_NE(r.output.find(fragment), std::string::npos) << "missing '" << fragment << "' in:\n" << r.output;
}

// The gate runs in both math modes (ModelGate.* on the CPU): the command takes the mode as a flag
// and reports it.
TEST_F(ModelCli, FastMathFlagIsTakenAndReported) {
  for (bool fast : {false, true}) {
    const CliResult r = run_cli(std::string("model --backend cpu --limit 2 --batch 2 --gate 0 --json") +
                                (fast ? " --fast-math" : ""));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["fast_math"], fast);
    EXPECT_EQ(j["total"], 2);
  }
  const CliResult r = run_cli("model --backend cpu --limit 2 --batch 2 --gate 0 --show 0 --fast-math");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("fast_math on"), std::string::npos) << r.output;
}

// The FP8 mode (docs/numerics.md) on the cpu backend: the example model keeps its gate, `run`
// passes its check against the FP64 ideal and reports the mode; a wrong value is refused.
TEST_F(ModelCli, Fp8PrecisionPassesTheGateOnTheCpu) {
  const CliResult r = run_cli("model --backend cpu --precision fp8 --fp8-min-rows 0 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["precision"], "fp8");
  EXPECT_EQ(j["total"], 200);
  EXPECT_GE(j["accuracy"].get<double>(), 0.95) << r.output;
}

TEST_F(Cli, RunTakesThePrecision) {
  const CliResult r = run_cli("run --shape small --tokens 32 --backend cpu --precision fp8 "
                              "--fp8-min-rows 0 --json --iters 1 --warmup 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["precision"], "fp8");
  EXPECT_EQ(j["check"]["pass"], true) << r.output;
  const CliResult bad = run_cli("run --shape small --tokens 8 --backend cpu --precision bf16");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--precision"), std::string::npos) << bad.output;
}

TEST_F(Cli, JsonRunWithOptions) {
  const CliResult r = run_cli(
      "run --json --tokens 24 --activation situ:beta=3,linear_beta=20 --exact --routing skewed "
      "--ep-size 2 --ep-rank 1 --seed 5 --backend cpu --iters 1 --warmup 0 --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["shape"]["name"], "small");
  EXPECT_EQ(j["tokens"], 24);
  EXPECT_EQ(j["activation"], "situ:beta=3,linear_beta=20");
  EXPECT_EQ(j["fast_math"], false);
  EXPECT_EQ(j["routing"], "skewed");
  EXPECT_EQ(j["backend"], "cpu");
  EXPECT_EQ(j["ep"]["first_local_expert"], 16);
  EXPECT_EQ(j["threads"], 1);
  EXPECT_EQ(j["check"]["pass"], true);
  EXPECT_LT(j["check"]["diff"].get<double>(), 1e-2);
  EXPECT_GT(j["check"]["diff"].get<double>(), 0.0);
  EXPECT_GE(j["check"]["worst_expert"].get<int>(), 16) << "only local experts are reported";
  EXPECT_GT(j["time_ms"]["median"].get<double>(), 0.0);
}

TEST_F(Cli, ShapeOverridesAndZeroTokens) {
  CliResult r = run_cli("run --shape gpt-oss-120b --hidden 320 --intermediate 320 --experts 16 --tokens 8 --iters 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("H=320 I=320 E=16 K=4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("swiglu_oai:alpha=1.702,clamp=7 (with expert biases)"), std::string::npos) << r.output;
  r = run_cli("run --tokens 0 --json --iters 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["check"]["diff"], 0.0);
}

TEST_F(Cli, BadInputIsReportedNotCrashed) {
  CliResult r = run_cli("run --activation situ:clamp=7");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("situ takes no clamp"), std::string::npos) << r.output;
  r = run_cli("run --shape huge");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("unknown preset 'huge'"), std::string::npos) << r.output;
  r = run_cli("run --ep-size 3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("ep_size 3 must divide num_experts 32"), std::string::npos) << r.output;
  r = run_cli("run --backend tpu");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("unknown backend 'tpu'"), std::string::npos) << r.output;
  r = run_cli("run --tokens abc");
  EXPECT_NE(r.exit_code, 0);
  r = run_cli("run --max-diff 1e-9 --tokens 8 --iters 1");
  EXPECT_EQ(r.exit_code, 3) << "a failed accuracy check exits 3:\n" << r.output;
  EXPECT_NE(r.output.find("FAIL"), std::string::npos) << r.output;
  r = run_cli("");
  EXPECT_NE(r.exit_code, 0) << "a subcommand is required";
}

// --ep-size without --ep-rank: on the sm90 backend all R ranks run as virtual ranks of one EP
// group on the GPU (checked against an EP=1 layer); on the cpu backend, which has no
// communication, it is rank 0's slice, and the output says so.
TEST_F(Cli, EpSizeWithoutRankIsVirtualOnSm90AndRankZeroOnCpu) {
  CliResult r = run_cli("run --json --ep-size 2 --tokens 16 --iters 1 --warmup 0 --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  if (j["backend"] == "cpu") {
    EXPECT_EQ(j["ep"]["mode"], "slice");
    EXPECT_EQ(j["ep"]["rank"], 0);
    EXPECT_EQ(j["ep"]["first_local_expert"], 0);
    EXPECT_EQ(j["ep"]["local_experts"], 16);
  } else {
    EXPECT_EQ(j["backend"], "sm90");
    EXPECT_EQ(j["ep"]["mode"], "virtual");
    EXPECT_EQ(j["ep"]["size"], 2);
    EXPECT_EQ(j["ep"]["total_tokens"], 32);
    ASSERT_EQ(j["ep"]["ranks"].size(), 2u);
    EXPECT_EQ(j["ep"]["ranks"][1]["first_local_expert"], 16);
    EXPECT_GT(j["ep"]["ranks"][1]["time_ms"]["median"].get<double>(), 0.0);
    EXPECT_EQ(j["ep"]["check"]["elements"], 32 * 1024);
    EXPECT_GE(j["ep"]["check"]["mismatches"].get<int64_t>(), 0);
    EXPECT_LT(j["ep"]["check"]["diff"].get<double>(), 1e-4);
  }
  EXPECT_EQ(j["check"]["pass"], true);

  r = run_cli("run --ep-size 2 --tokens 8 --iters 1 --warmup 0 --backend cpu");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* fragment : {"EP rank 0 of 2: local experts [0, 16)",
                               "note        --ep-size without --ep-rank runs rank 0's slice on the "
                               "cpu backend; all 2 ranks exchanging tokens (virtual ranks) need the "
                               "sm90 backend"})
    EXPECT_NE(r.output.find(fragment), std::string::npos) << "missing '" << fragment << "' in:\n" << r.output;
  r = run_cli("run --ep-size 2 --ep-rank 0 --tokens 8 --iters 1 --warmup 0 --backend cpu --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["ep"]["mode"], "slice") << "an explicit --ep-rank is one rank on every backend";

  // Explicitly on sm90: the virtual ranks, or "unsupported" where there is no sm_90 GPU.
  r = run_cli("run --backend sm90 --ep-size 4 --tokens 4 --iters 1 --warmup 0");
  if (r.exit_code == 0) {
    EXPECT_NE(r.output.find("EP 4 virtual ranks on one GPU"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("vs EP=1"), std::string::npos) << r.output;
  } else {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("error (unsupported)"), std::string::npos) << r.output;
  }
}

TEST_F(Cli, EpFlagsAreValidated) {
  const std::pair<const char*, const char*> cases[] = {
      {"run --ep-size 3", "ep_size 3 must divide num_experts 32"},
      {"run --ep-size 8 --experts 12", "ep_size 8 must divide num_experts 12"},
      {"run --ep-size 0", "ep_size must be >= 1, got 0"},
      {"run --ep-size 2 --ep-timeout 0", "--ep-timeout must be a number of seconds in (0, 3600], got 0"},
      {"run --ep-size 2 --ep-timeout -1.5", "--ep-timeout must be a number of seconds in (0, 3600], got -1.5"},
      {"run --ep-size 2 --ep-timeout 7200", "--ep-timeout must be a number of seconds in (0, 3600], got 7200"},
      {"run --ep-size 2 --ep-max-recv-rows -1", "--ep-max-recv-rows must be >= 0 (0 = the worst case), got -1"},
      {"model --ep-size 3", "ep_size 3 must divide num_experts 32"},
      {"model --ep-size 0", "model: ep_size must be >= 1, got 0"},
      {"run --ep-size 2 --mega-dispatch",
       "sm90.mega_dispatch (the dispatch inside the MegaMoE kernel) needs sm90.mega_kernel"},
      {"run --mega-combine",
       "sm90.mega_combine (the combine inside the MegaMoE kernel) needs sm90.mega_kernel"},
  };
  for (const auto& [args, fragment] : cases) {
    SCOPED_TRACE(args);
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("error (invalid argument)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos) << r.output;
  }
  const CliResult r = run_cli("model --ep-size 2 --backend cpu");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error (unsupported): model: ep_size 2 runs each MoE layer on 2 virtual "
                          "ranks of one GPU, which needs the sm90 backend; the backend here is 'cpu'"),
            std::string::npos)
      << r.output;
}

TEST_F(Cli, HelpDocumentsEveryOption) {
  CliResult r = run_cli("--help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("run"), std::string::npos) << r.output;
  r = run_cli("run --help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt : {"--shape", "--tokens", "--activation", "--backend", "--exact", "--seed",
                          "--ep-size", "--ep-rank", "--routing", "--bias", "--capacity", "--warmup",
                          "--iters", "--threads", "--no-check", "--max-diff", "--json", "--hidden",
                          "--intermediate", "--experts", "--top-k", "--ep-timeout",
                          "--ep-max-recv-rows", "--mega", "--mega-dispatch", "--mega-combine", "virtual ranks",
                          "On the cpu backend"})
    EXPECT_NE(r.output.find(opt), std::string::npos) << opt << " undocumented:\n" << r.output;
  r = run_cli("model --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("--ep-size"), std::string::npos) << r.output;
}

}  // namespace
