#pragma once
// The ferry version these headers are. Kept in the tree, so that a checkout used with -Iinclude
// alone compiles; the build refuses to configure when it differs from meson.build's version
// (include/ferry/meson.build).

#include "ferry/detail/config.hpp"

#define FERRY_VERSION_MAJOR 0
#define FERRY_VERSION_MINOR 1
#define FERRY_VERSION_PATCH 0
#define FERRY_VERSION_STRING "0.1.0"
