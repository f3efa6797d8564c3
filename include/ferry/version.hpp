#pragma once
/// \file
/// The ferry version these headers are. Kept in the tree, so that a checkout used with -Iinclude
/// alone compiles; the build refuses to configure when it differs from meson.build's version
/// (include/ferry/meson.build).

#include "ferry/detail/config.hpp"

/// The major version (CMake's find_package(ferry X.Y) accepts only the same major version).
#define FERRY_VERSION_MAJOR 0
/// The minor version.
#define FERRY_VERSION_MINOR 1
/// The patch version.
#define FERRY_VERSION_PATCH 0
/// The version as "MAJOR.MINOR.PATCH".
#define FERRY_VERSION_STRING "0.1.0"
