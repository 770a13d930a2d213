#include "kvq/spec.h"

#include <gtest/gtest.h>

#include <random>

#include "kvq/cache.h"

namespace kvq {
namespace {

TEST(Spec, CanonicalFormListsEveryParameter) {
  auto s = parse_spec("kivi");
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->to_string(), "kivi:k_bits=2,v_bits=2,group=32,residual=128");
  auto t = parse_spec(" kivi : v_bits=4 , k_bits=3 ");
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->to_string(), "kivi:k_bits=3,v_bits=4,group=32,residual=128");
  EXPECT_EQ(parse_spec("fp16")->to_string(), "fp16");
  EXPECT_EQ(parse_spec("kivi:")->to_string(), parse_spec("kivi")->to_string());
}

TEST(Spec, RoundTripsForEveryMethodAndRandomValues) {
  std::mt19937 rng(11);
  for (const auto& m : method_table()) {
    for (int trial = 0; trial < 50; ++trial) {
      Spec s(m);
      for (const auto& p : m.params) {
        std::string v;
        if (p.type == ParamType::kEnum) {
          v = p.choices[rng() % p.choices.size()];
        } else if (p.type == ParamType::kInt) {
          const long long lo = static_cast<long long>(p.min), hi = static_cast<long long>(p.max);
          v = std::to_string(lo + static_cast<long long>(
                                      rng() % static_cast<uint64_t>(std::min(hi - lo + 1, 64LL))));
        } else {
          std::uniform_real_distribution<double> u(p.min, p.max);
          v = format_param_value(p, u(rng));
        }
        ASSERT_TRUE(s.set(p.name, v).ok()) << m.name << ":" << p.name << "=" << v;
      }
      if (m.validate && !m.validate(s).ok()) continue;  // an invalid combination
      auto back = parse_spec(s.to_string());
      ASSERT_TRUE(back.ok()) << s.to_string() << ": " << back.status().to_string();
      EXPECT_EQ(*back, s) << s.to_string();
      EXPECT_EQ(back->to_string(), s.to_string());
    }
    // Defaults round-trip too.
    EXPECT_EQ(parse_spec(Spec(m).to_string())->to_string(), Spec(m).to_string());
  }
}

TEST(Spec, HelpfulErrors) {
  auto e = parse_spec("kiwi");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("unknown method 'kiwi' (did you mean 'kivi'?)"),
            std::string::npos)
      << e.status().message();
  e = parse_spec("kivi:kbits=2");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("did you mean 'k_bits'"), std::string::npos)
      << e.status().message();
  e = parse_spec("kivi:k_bits=9");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("out of range [1, 8]"), std::string::npos)
      << e.status().message();
  e = parse_spec("kivi:k_bits=two");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("expects an integer"), std::string::npos);
  e = parse_spec("kivi:k_bits=2,k_bits=3");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("given twice"), std::string::npos);
  e = parse_spec("kivi:k_bits");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("expected key=value"), std::string::npos);
  e = parse_spec("kivi:k_bits=2,");
  ASSERT_FALSE(e.ok());
  e = parse_spec("");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("empty method name"), std::string::npos);
  e = parse_spec("fp16:bits=3");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("takes no parameters"), std::string::npos);
  e = parse_spec("kivi:k_bits=2.5");
  ASSERT_FALSE(e.ok());
}

TEST(Spec, SetLeavesSpecUnchangedOnError) {
  Spec s = *parse_spec("kivi:k_bits=3");
  const Spec before = s;
  EXPECT_FALSE(s.set("k_bits", "99").ok());
  EXPECT_FALSE(s.apply("v_bits=4,k_bits=0").ok());
  EXPECT_EQ(s, before);
}

TEST(ModelSpec, PerLayerOverridesParseAndPrintCanonically) {
  auto ms = parse_model_spec("kivi:k_bits=2@0-2:k_bits=4,v_bits=4@1:v_bits=3@5:k_bits=2");
  ASSERT_TRUE(ms.ok()) << ms.status().to_string();
  EXPECT_EQ(ms->to_string(),
            "kivi:k_bits=2,v_bits=2,group=32,residual=128@0:k_bits=4,v_bits=4@1:k_bits=4,v_bits=3"
            "@2:k_bits=4,v_bits=4");  // layer 5's override equals the base: dropped
  auto again = parse_model_spec(ms->to_string());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->to_string(), ms->to_string());
  EXPECT_FALSE(parse_model_spec("kivi@x:k_bits=2").ok());
  EXPECT_FALSE(parse_model_spec("kivi@3-1:k_bits=2").ok());
  EXPECT_FALSE(parse_model_spec("kivi@1k_bits=2").ok());
  auto e = parse_model_spec("kivi@1:k_bitz=2");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("layer 1"), std::string::npos);
  auto cache = ModelCache::create("kivi@1:k_bits=4", ModelShape::uniform(2, 1, 8));
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->layer(1).spec().get_int("k_bits"), 4);
  EXPECT_FALSE(ModelCache::create("kivi@2:k_bits=4", ModelShape::uniform(2, 1, 8)).ok());
}

TEST(Spec, ClosestMatch) {
  EXPECT_EQ(closest_match("residul", {"group", "residual"}), "residual");
  EXPECT_EQ(closest_match("zzzzzzzz", {"group", "residual"}), "");
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3);
}

}  // namespace
}  // namespace kvq
