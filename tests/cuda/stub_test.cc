#include <gtest/gtest.h>
TEST(Cuda, Stub) {}
