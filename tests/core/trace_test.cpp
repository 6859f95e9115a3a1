// TraceRecorder: nested scopes become complete events that Chrome's trace viewer can read.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <thread>

#include "fusekit/core/trace.hpp"

namespace fk {
namespace {

TEST(TraceRecorder, NestedScopesWriteCompleteEvents) {
  TraceRecorder rec;
  {
    const auto outer = trace_scope(&rec, "outer", "train");
    const auto inner = trace_scope(&rec, "inner");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  { const auto nothing = trace_scope(nullptr, "ignored"); }
  ASSERT_EQ(rec.size(), 2u);
  const auto path = std::filesystem::temp_directory_path() / "fusekit_trace_test.json";
  rec.write(path);
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  const auto& ev = j.at("traceEvents");
  ASSERT_EQ(ev.size(), 2u);
  // The inner scope ends first; the outer one contains it.
  EXPECT_EQ(ev[0].at("name"), "inner");
  EXPECT_EQ(ev[1].at("name"), "outer");
  EXPECT_EQ(ev[1].at("cat"), "train");
  EXPECT_EQ(ev[0].at("ph"), "X");
  EXPECT_GE(ev[0].at("dur").get<double>(), 1500.0);
  EXPECT_LE(ev[1].at("ts").get<double>(), ev[0].at("ts").get<double>());
  EXPECT_GE(ev[1].at("dur").get<double>(), ev[0].at("dur").get<double>());
  rec.set_max_events(2);
  { const auto more = trace_scope(&rec, "dropped"); }
  EXPECT_EQ(rec.size(), 2u);
}

}  // namespace
}  // namespace fk
