// Activation: factories, validation and the textual spec "name[:key=value,...]" (numerics.md
// section 4). The evaluation itself lives in include/megamoe/activation.hpp (host + device).
#include "megamoe/activation.hpp"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "megamoe/error.hpp"

namespace megamoe {

namespace {

constexpr std::string_view kSwigluName = "swiglu";
constexpr std::string_view kSituName = "situ";
constexpr std::string_view kSwigluOaiName = "swiglu_oai";

// Shortest decimal text that reads back to exactly `v`.
std::string format_float(float v) {
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

float parse_value(std::string_view spec, std::string_view key, std::string_view text) {
  const std::string str(text);
  MEGAMOE_CHECK_ARG(!str.empty(), "activation '", spec, "': parameter '", key,
                    "' has no value (expected ", key, "=<number>)");
  char* end = nullptr;
  const double v = std::strtod(str.c_str(), &end);
  MEGAMOE_CHECK_ARG(end == str.c_str() + str.size(), "activation '", spec, "': parameter '", key,
                    "' expected a number, got '", str, "'");
  const float f = static_cast<float>(v);
  MEGAMOE_CHECK_ARG(!(std::isfinite(v) && !std::isfinite(f)), "activation '", spec,
                    "': parameter '", key, "' = ", str, " overflows float32");
  return f;
}

void check_positive_finite(const char* what, const char* param, float v) {
  MEGAMOE_CHECK_ARG(std::isfinite(v) && v > 0.0f, "activation ", what, ": ", param,
                    " must be finite and > 0, got ", format_float(v));
}

void check_clamp(const char* what, float v) {
  MEGAMOE_CHECK_ARG(std::isfinite(v) && v >= 0.0f, "activation ", what,
                    ": clamp must be finite and >= 0, got ", format_float(v));
}

}  // namespace

Activation Activation::swiglu() {
  Activation a;
  a.kind = ActivationKind::kSwiglu;
  return a;
}

Activation Activation::swiglu_clamped(float limit) {
  Activation a = swiglu();
  a.has_clamp = true;
  a.clamp = limit;
  a.validate();
  return a;
}

Activation Activation::situ(float beta, float linear_beta) {
  Activation a;
  a.kind = ActivationKind::kSitu;
  a.beta = beta;
  a.linear_beta = linear_beta;
  a.validate();
  return a;
}

Activation Activation::swiglu_oai(float alpha, float limit) {
  Activation a;
  a.kind = ActivationKind::kSwigluOai;
  a.alpha = alpha;
  a.has_clamp = true;
  a.clamp = limit;
  a.validate();
  return a;
}

void Activation::validate() const {
  switch (kind) {
    case ActivationKind::kSwiglu:
      if (has_clamp) check_clamp("swiglu", clamp);
      return;
    case ActivationKind::kSitu:
      MEGAMOE_CHECK_ARG(!has_clamp, "activation situ: a clamp is not allowed (situ bounds g and u ",
                        "through tanh; got clamp=", format_float(clamp), ")");
      check_positive_finite("situ", "beta", beta);
      check_positive_finite("situ", "linear_beta", linear_beta);
      return;
    case ActivationKind::kSwigluOai:
      MEGAMOE_CHECK_ARG(has_clamp, "activation swiglu_oai: the clamp (limit) is required");
      check_clamp("swiglu_oai", clamp);
      check_positive_finite("swiglu_oai", "alpha", alpha);
      return;
  }
  fail(ErrorCode::kInvalidArgument, "activation: unknown kind ", static_cast<int>(kind));
}

Activation Activation::parse(std::string_view spec_in) {
  const std::string_view spec = trim(spec_in);
  const size_t colon = spec.find(':');
  const std::string_view name = trim(spec.substr(0, colon));
  Activation a;
  if (name == kSwigluName) {
    a = swiglu();
  } else if (name == kSituName) {
    a.kind = ActivationKind::kSitu;
  } else if (name == kSwigluOaiName) {
    a.kind = ActivationKind::kSwigluOai;
    a.has_clamp = true;
    a.clamp = 7.0f;
  } else {
    fail(ErrorCode::kInvalidArgument, "activation '", spec, "': unknown name '", name,
         "' (expected swiglu, situ or swiglu_oai)");
  }

  std::vector<std::string> seen;
  if (colon != std::string_view::npos) {
    std::string_view rest = spec.substr(colon + 1);
    MEGAMOE_CHECK_ARG(!trim(rest).empty(), "activation '", spec,
                      "': expected key=value parameters after ':'");
    while (true) {
      const size_t comma = rest.find(',');
      const std::string_view item = trim(rest.substr(0, comma));
      const size_t eq = item.find('=');
      MEGAMOE_CHECK_ARG(eq != std::string_view::npos, "activation '", spec, "': parameter '", item,
                        "' is not of the form key=value");
      std::string key(trim(item.substr(0, eq)));
      const float value = parse_value(spec, key, trim(item.substr(eq + 1)));
      // Aliases: "limit" is GPT-OSS's name for the clamp, "lbeta" short for linear_beta.
      if (key == "limit") key = "clamp";
      if (key == "lbeta") key = "linear_beta";
      for (const auto& s : seen)
        MEGAMOE_CHECK_ARG(s != key, "activation '", spec, "': parameter '", key, "' given twice");
      seen.push_back(key);

      if (key == "clamp" && a.kind != ActivationKind::kSitu) {
        a.has_clamp = true;
        a.clamp = value;
      } else if (key == "clamp") {
        fail(ErrorCode::kInvalidArgument, "activation '", spec,
             "': situ takes no clamp (situ bounds g and u through tanh)");
      } else if ((key == "beta" || key == "linear_beta") && a.kind == ActivationKind::kSitu) {
        (key == "beta" ? a.beta : a.linear_beta) = value;
      } else if (key == "alpha" && a.kind == ActivationKind::kSwigluOai) {
        a.alpha = value;
      } else {
        const char* allowed = a.kind == ActivationKind::kSwiglu  ? "clamp"
                              : a.kind == ActivationKind::kSitu ? "beta, linear_beta"
                                                                : "alpha, clamp";
        fail(ErrorCode::kInvalidArgument, "activation '", spec, "': unknown parameter '", key,
             "' for ", name, " (allowed: ", allowed, ")");
      }
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
  }
  a.validate();
  return a;
}

std::string Activation::name() const {
  switch (kind) {
    case ActivationKind::kSwiglu: return std::string(kSwigluName);
    case ActivationKind::kSitu: return std::string(kSituName);
    case ActivationKind::kSwigluOai: return std::string(kSwigluOaiName);
  }
  return "unknown";
}

std::string Activation::to_string() const {
  switch (kind) {
    case ActivationKind::kSwiglu:
      return has_clamp ? name() + ":clamp=" + format_float(clamp) : name();
    case ActivationKind::kSitu:
      return name() + ":beta=" + format_float(beta) + ",linear_beta=" + format_float(linear_beta);
    case ActivationKind::kSwigluOai:
      return name() + ":alpha=" + format_float(alpha) + ",clamp=" + format_float(clamp);
  }
  return "unknown";
}

}  // namespace megamoe
