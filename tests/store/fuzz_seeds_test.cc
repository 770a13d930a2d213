// The store fuzz target's seeds (fuzz/corpus/store/): the valid objects of its world, as fuzz
// inputs. KVQ_WRITE_FUZZ_SEEDS=1 kvq_store_tests --gtest_filter=StoreFuzzSeeds.Write rewrites
// them; the check below fails when they no longer stand for the world's objects.
#include <gtest/gtest.h>

#include "../fuzz/store_input.h"
#include "core/file_io.h"
#include "test_util.h"

namespace kvq {
namespace {

std::string seed_path(const char* name) {
  return testing::source_dir() + "/fuzz/corpus/store/" + name;
}

TEST(StoreFuzzSeeds, Write) {
  if (!std::getenv("KVQ_WRITE_FUZZ_SEEDS"))
    GTEST_SKIP() << "set KVQ_WRITE_FUZZ_SEEDS=1 to (re)write the seeds";
  const fuzz::StoreWorld& w = fuzz::store_world();
  for (const auto& [name, object] :
       {std::pair{"blocks_0", &w.chunk0.blocks}, std::pair{"tail_0", &w.chunk0.tail}}) {
    const auto in = fuzz::store_input_of(*object);
    ASSERT_TRUE(write_file_atomic(seed_path(name), in.data(), in.size()).ok());
  }
}

TEST(StoreFuzzSeeds, SeedsAreTheWorldsObjects) {
  const fuzz::StoreWorld& w = fuzz::store_world();
  for (const auto& [name, object] :
       {std::pair{"blocks_0", &w.chunk0.blocks}, std::pair{"tail_0", &w.chunk0.tail}}) {
    auto seed = read_file(seed_path(name));
    ASSERT_TRUE(seed.ok()) << name;
    EXPECT_EQ(fuzz::store_object_of(seed->data(), seed->size()), *object)
        << name << ": rewrite the seeds (KVQ_WRITE_FUZZ_SEEDS=1 kvq_store_tests "
                   "--gtest_filter=StoreFuzzSeeds.Write)";
  }
}

}  // namespace
}  // namespace kvq
