// What the GPU tests share: skipping, saying so, when no CUDA device is visible.
#pragma once

#include <gtest/gtest.h>

#include "kvq/cuda.h"

#define REQUIRE_GPU()                                                                          \
  do {                                                                                         \
    if (kvq::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible: GPU test skipped"; \
  } while (0)
