#!/usr/bin/env bash
# Installs (Debian/Ubuntu, apt-get) whatever megamoe's build needs and this machine lacks:
# a C++20 compiler, CMake >= 3.24, Ninja, GoogleTest, nlohmann-json and CLI11. Installs nothing
# when everything is present, so it is cheap to run before every build. nvcc is optional: the
# CUDA backends are built when it is found (CMake looks in PATH and /usr/local/cuda).
set -euo pipefail

missing=()
need_cmd() { command -v "$1" >/dev/null 2>&1 || missing+=("$2"); }
need_file() { [ -e "$1" ] || missing+=("$2"); }

need_cmd g++ g++
need_cmd cmake cmake
need_cmd ninja ninja-build
need_file /usr/include/gtest/gtest.h libgtest-dev
need_file /usr/include/nlohmann/json.hpp nlohmann-json3-dev
need_file /usr/include/CLI/CLI.hpp libcli11-dev

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all build dependencies present"
else
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq </dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
fi

cmake_version="$(cmake --version | head -n1 | awk '{print $3}')"
if [ "$(printf '%s\n3.24\n' "$cmake_version" | sort -V | head -n1)" != "3.24" ]; then
  echo "install-deps: CMake $cmake_version is older than 3.24 (pip install cmake gives a newer one)" >&2
  exit 1
fi
