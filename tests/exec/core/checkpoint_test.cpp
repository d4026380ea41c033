#include "exec/core/checkpoint.hpp"

#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>

#include "sim/common/error.hpp"
#include "tests/json_mutants.hpp"

namespace fs = std::filesystem;
using dtsim::exec::Checkpoint;
using dtsim::exec::CheckpointReader;
using dtsim::exec::CheckpointTensor;
using dtsim::exec::ShardWriter;
using dtsim::exec::Slice;

namespace {

// A fresh folder under the temporary directory (and its .tmp and .old siblings gone).
std::string folder(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("dtexec_checkpoint_test_" + name);
  for (const auto* suffix : {"", ".tmp", ".old"}) fs::remove_all(dir.string() + suffix);
  return dir.string();
}

// A [rows, cols] tensor whose weight, m and v at flat index i are i, 1000 + i and 2000 + i.
CheckpointTensor numbered(const std::string& name, std::int64_t rows, std::int64_t cols) {
  CheckpointTensor t{name, {rows, cols}, {}, {}, {}};
  const auto n = static_cast<std::size_t>(rows * cols);
  for (std::size_t i = 0; i < n; ++i) {
    t.data.push_back(static_cast<float>(i));
    t.m.push_back(static_cast<float>(1000 + i));
    t.v.push_back(static_cast<float>(2000 + i));
  }
  return t;
}

dtsim::exec::CheckpointInfo info() {
  dtsim::exec::CheckpointInfo c;
  c.model = "tiny-gpt";
  c.plan = {{"dp", 2}};
  c.step = 2;
  c.seed = 7;
  c.learning_rate = 1e-3;
  c.weight_decay = 0.1;
  c.losses = {5.5, 5.25};
  return c;
}

// Adds elements [begin, begin + count) of `slice` of `full` to `shard`, as a rank would.
void add_piece(ShardWriter& shard, const CheckpointTensor& full, const Slice& slice,
               std::int64_t begin, std::int64_t count) {
  std::vector<float> w, m, v;
  for (std::int64_t i = begin; i < begin + count; ++i) {
    const auto at = static_cast<std::size_t>(slice.full_index(i));
    w.push_back(full.data[at]);
    m.push_back(full.m[at]);
    v.push_back(full.v[at]);
  }
  shard.add(full.name, slice, begin, w, m, v);
}

// A checkpoint of two tensors written as tp 2 x ZeRO dp 2 would shard them: a [4, 6] QKV-like
// matrix split by column ranges (rank t holds columns [t, t + 1) of each of three blocks of
// two), and a [4, 3] row-parallel one split by rows, each tp slice split in two dp ranges.
std::string write_sharded(const std::string& name, const CheckpointTensor& qkv,
                          const CheckpointTensor& out) {
  const std::string dir = folder(name);
  dtsim::exec::begin_checkpoint(dir);
  std::vector<nlohmann::json> indices;
  for (int t = 0; t < 2; ++t) {
    const Slice columns{4, 6, 0, 4, {{t, 1}, {2 + t, 1}, {4 + t, 1}}};
    const Slice rows{4, 3, 2 * t, 2, {{0, 3}}};
    for (int d = 0; d < 2; ++d) {
      ShardWriter shard(dir, t * 2 + d);
      add_piece(shard, qkv, columns, d * 5, d == 0 ? 5 : 7);  // 12 elements: 5 + 7
      add_piece(shard, out, rows, d * 3, 3);
      indices.push_back(shard.close());
    }
  }
  indices.push_back(ShardWriter(dir, 4).close());  // a rank with nothing to write
  CHECK(indices.back().is_null());
  CHECK(dtsim::exec::finish_checkpoint(dir, info(), indices) == (24 + 12) * 12);
  return dir;
}

void rewrite_index(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  std::ifstream(fs::path(dir) / "checkpoint.json") >> j;
  edit(j);
  std::ofstream(fs::path(dir) / "checkpoint.json") << j.dump(1);
}

}  // namespace

TEST_CASE("checkpoint: one writer's whole tensors read back", "[exec][checkpoint]") {
  const std::string dir = folder("whole");
  Checkpoint c;
  static_cast<dtsim::exec::CheckpointInfo&>(c) = info();
  c.tensors = {numbered("a.weight", 3, 5), numbered("a.bias", 1, 5)};
  dtsim::exec::write_checkpoint(dir, c);
  CHECK(fs::exists(fs::path(dir) / "rank-00000.bin"));
  CHECK_FALSE(fs::exists(dir + ".tmp"));
  const Checkpoint back = dtsim::exec::read_checkpoint(dir);
  CHECK(back.model == "tiny-gpt");
  CHECK(back.plan == c.plan);
  CHECK(back.step == 2);
  CHECK(back.seed == 7);
  CHECK(back.weight_decay == 0.1);
  CHECK(back.losses == c.losses);
  REQUIRE(back.tensors.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(back.tensors[i].name == c.tensors[i].name);
    CHECK(back.tensors[i].shape == c.tensors[i].shape);
    CHECK(back.tensors[i].data == c.tensors[i].data);
    CHECK(back.tensors[i].m == c.tensors[i].m);
    CHECK(back.tensors[i].v == c.tensors[i].v);
  }
  // Written again over it: the new one replaces it, no .old left behind.
  c.step = 3;
  c.losses.push_back(5.0);
  dtsim::exec::write_checkpoint(dir, c);
  CHECK(dtsim::exec::read_checkpoint(dir).step == 3);
  CHECK_FALSE(fs::exists(dir + ".old"));
}

TEST_CASE("checkpoint: shards of column, row and dp slices assemble the full tensors",
          "[exec][checkpoint]") {
  const auto qkv = numbered("L0.qkv.weight", 4, 6);
  const auto out = numbered("L0.out.weight", 4, 3);
  const std::string dir = write_sharded("sharded", qkv, out);
  const CheckpointReader reader(dir);
  CHECK(reader.shards() == 4);
  CHECK(reader.names() == std::vector<std::string>{"L0.qkv.weight", "L0.out.weight"});
  REQUIRE(reader.shape("L0.qkv.weight") != nullptr);
  CHECK(*reader.shape("L0.qkv.weight") == std::vector<std::int64_t>{4, 6});
  CHECK(reader.shape("nope") == nullptr);
  for (const auto* full : {&qkv, &out}) {
    const auto t = reader.read(full->name);
    CHECK(t.data == full->data);
    CHECK(t.m == full->m);
    CHECK(t.v == full->v);
  }
}

TEST_CASE("checkpoint: the first format (one tensors.bin) is still read", "[exec][checkpoint]") {
  const std::string dir = folder("format1");
  fs::create_directories(dir);
  const auto a = numbered("a.weight", 2, 3);
  const auto b = numbered("b.bias", 1, 4);
  {
    std::ofstream bin(fs::path(dir) / "tensors.bin", std::ios::binary);
    for (const auto* t : {&a, &b}) {
      for (const auto* part : {&t->data, &t->m, &t->v}) {
        bin.write(reinterpret_cast<const char*>(part->data()),
                  static_cast<std::streamsize>(part->size() * sizeof(float)));
      }
    }
  }
  nlohmann::json j{{"format", "dtexec-checkpoint-1"},
                   {"model", "tiny-gpt"},
                   {"plan", {{"dp", 1}}},
                   {"step", 1},
                   {"seed", 1234},
                   {"learning_rate", 0.003},
                   {"losses", {5.5}},
                   {"tensors",
                    {{{"name", "a.weight"}, {"shape", {2, 3}}, {"offset", 0}},
                     {{"name", "b.bias"}, {"shape", {1, 4}}, {"offset", 18}}}}};
  std::ofstream(fs::path(dir) / "checkpoint.json") << j.dump();
  const Checkpoint c = dtsim::exec::read_checkpoint(dir);
  REQUIRE(c.tensors.size() == 2);
  CHECK(c.tensors[0].data == a.data);
  CHECK(c.tensors[0].v == a.v);
  CHECK(c.tensors[1].m == b.m);
  CHECK(c.weight_decay == 0);
  CHECK(c.lr_schedule.is_null());
}

TEST_CASE("checkpoint: compare matches tensors by name", "[exec][checkpoint]") {
  Checkpoint a;
  static_cast<dtsim::exec::CheckpointInfo&>(a) = info();
  a.tensors = {numbered("x", 1, 3), numbered("y", 2, 2)};
  Checkpoint b = a;
  std::swap(b.tensors[0], b.tensors[1]);
  b.tensors[0].data[3] += 0.5f;  // y
  auto d = dtsim::exec::compare_checkpoints(a, b);
  CHECK(d.problems.empty());
  CHECK(d.max_weight_diff == Approx(0.5));
  CHECK(d.worst_tensor == "y");
  b.tensors[1].name = "z";
  d = dtsim::exec::compare_checkpoints(a, b);
  CHECK(d.problems == std::vector<std::string>{"tensor x is in the first only",
                                               "tensor z is in the second only"});
  // A NaN is not a difference of infinity alone: it is named.
  b = a;
  b.tensors[1].data[0] = std::numeric_limits<float>::quiet_NaN();
  d = dtsim::exec::compare_checkpoints(a, b);
  CHECK(d.problems == std::vector<std::string>{"tensor y: a weight is not finite"});
  CHECK(std::isinf(d.max_weight_diff));
}

TEST_CASE("checkpoint: bad folders are refused with the file and the field", "[exec][checkpoint]") {
  const auto qkv = numbered("L0.qkv.weight", 4, 6);
  const auto out = numbered("L0.out.weight", 4, 3);
  using Catch::Contains;
  SECTION("a shard missing") {
    const auto dir = write_sharded("bad_missing", qkv, out);
    fs::remove(fs::path(dir) / "rank-00002.bin");
    REQUIRE_THROWS_AS(CheckpointReader(dir), dtsim::InputError);
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("rank-00002.bin: cannot open"));
  }
  SECTION("a shard cut short") {
    const auto dir = write_sharded("bad_short", qkv, out);
    fs::resize_file(fs::path(dir) / "rank-00001.bin", 40);
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("rank-00001.bin: 40 bytes, expected 120 (a shard cut short?)"));
  }
  SECTION("a piece's rows outside its tensor") {
    const auto dir = write_sharded("bad_rows", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][0]["pieces"][1]["rows"] = {3, 2}; });
    REQUIRE_THROWS_WITH(
        CheckpointReader(dir),
        Contains("shards: rank-00000.bin: a piece of L0.out.weight: rows [3,2]: expected [first, "
                 "count] inside 4 rows"));
  }
  SECTION("a piece's columns outside its tensor") {
    const auto dir = write_sharded("bad_cols", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) {
      j["shards"][0]["pieces"][0]["cols"] = {{0, 4}, {3, 4}};
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("a piece of L0.qkv.weight: cols"));
  }
  SECTION("a piece elsewhere than after the one before it, or past its file") {
    const auto dir = write_sharded("bad_offset", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][3]["pieces"][1]["offset"] = 100; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("offset 100: expected 84, where the piece before it ends, with "
                                 "its 36 bytes inside the file (120)"));
  }
  SECTION("pieces that do not fill their file") {
    const auto dir = write_sharded("bad_fill", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][3]["pieces"].erase(1); });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("shards: rank-00003.bin: its pieces hold 84 bytes, the file 120"));
  }
  SECTION("a field the reader does not know, in a piece, a shard or a tensor") {
    // (A hand edit or another version's field would be ignored in silence: refused, as at the
    // index's top level.)
    const auto dir = write_sharded("bad_field", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][0]["pieces"][0]["checksum"] = 1; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("a piece of L0.qkv.weight: checksum: unknown field"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["shards"][0]["pieces"][0].erase("checksum");
      j["shards"][1]["host"] = "node-3";
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("checkpoint.json: shards: host: unknown field"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["shards"][1].erase("host");
      j["tensors"][0]["dtype"] = "fp32";
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("checkpoint.json: tensors: dtype: unknown field"));
  }
  SECTION("a shard listed twice") {
    const auto dir = write_sharded("bad_twice", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][1] = j["shards"][0]; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("shards: rank-00000.bin is listed twice"));
  }
  SECTION("numbers that are not whole, or out of range") {
    const auto dir = write_sharded("bad_numbers", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][0]["pieces"][0]["count"] = 2.5; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("a piece of L0.qkv.weight: count: expected a whole number, got "
                                 "2.5"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["shards"][0]["pieces"][0]["count"] = 5;
      j["shards"][0]["pieces"][0]["rows"] = {0, "4"};
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("rows: expected a whole number, got \"4\""));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["shards"][0]["pieces"][0]["rows"] = {0, 4};
      j["step"] = 4294967298LL;  // 2^32 + 2: not wrapped to 2
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("step: expected a step count, got 4294967298"));
  }
  SECTION("a piece of a tensor not listed") {
    const auto dir = write_sharded("bad_tensor", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][0]["pieces"][0]["tensor"] = "nope"; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("a piece of nope, which is not in tensors"));
  }
  SECTION("a piece's range outside its slice") {
    const auto dir = write_sharded("bad_range", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][0]["pieces"][0]["begin"] = 10; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("begin 10, count 5: expected a range of its slice's 12 elements"));
  }
  SECTION("a shard file outside the folder") {
    const auto dir = write_sharded("bad_file", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][0]["file"] = "../rank-00000.bin"; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("expected a file name in the folder"));
  }
  SECTION("elements in no shard") {
    const auto dir = write_sharded("bad_cover", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"].erase(0); });  // rank 0's unlisted
    const CheckpointReader reader(dir);
    REQUIRE_THROWS_WITH(reader.read("L0.out.weight"),
                        Contains("L0.out.weight: 3 of the 12 elements read are in no shard"));
  }
  SECTION("elements in two pieces") {
    const auto dir = write_sharded("bad_twice_element", qkv, out);
    // Rank 1's 4..10 over rank 0's 0..4: element 4 twice.
    rewrite_index(dir, [](nlohmann::json& j) { j["shards"][1]["pieces"][0]["begin"] = 4; });
    const CheckpointReader reader(dir);
    REQUIRE_THROWS_WITH(reader.read("L0.qkv.weight"),
                        Contains("rank-00001.bin: an element of L0.qkv.weight is in two pieces"));
  }
  SECTION("another format, and a shape not [rows, cols]") {
    const auto dir = write_sharded("bad_format", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["format"] = "dtexec-checkpoint-9"; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("format: expected \"dtexec-checkpoint-2\""));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["format"] = "dtexec-checkpoint-2";
      j["tensors"][1]["shape"] = {2, 2, 3};
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("tensors: L0.out.weight: shape [2,2,3]: expected [rows, cols]"));
  }
  SECTION("a shape larger than the files") {
    const auto dir = write_sharded("bad_shape", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j["tensors"][0]["shape"] = {1000000, 1000000}; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("with no more elements than the checkpoint's files hold (36)"));
  }
  SECTION("a piece whose bytes are not those written: a damaged or swapped shard") {
    const auto dir = write_sharded("bad_crc", qkv, out);
    // Ranks 0 and 2 hold pieces of the same sizes (of other tp slices): swapped, each is read.
    fs::rename(fs::path(dir) / "rank-00002.bin", fs::path(dir) / "swap.bin");
    fs::rename(fs::path(dir) / "rank-00000.bin", fs::path(dir) / "rank-00002.bin");
    fs::rename(fs::path(dir) / "swap.bin", fs::path(dir) / "rank-00000.bin");
    const CheckpointReader reader(dir);
    REQUIRE_THROWS_WITH(reader.read("L0.qkv.weight"),
                        Contains("a piece of L0.qkv.weight does not match its checksum"));
  }
  SECTION("a crc32 that is no 32-bit checksum, and a shard longer than its pieces") {
    const auto dir = write_sharded("bad_crc_field", qkv, out);
    rewrite_index(dir,
                  [](nlohmann::json& j) { j["shards"][0]["pieces"][0]["crc32"] = 4294967296LL; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("a piece of L0.qkv.weight: crc32 4294967296: expected a 32-bit "
                                 "checksum"));
    const auto longer = write_sharded("bad_long", qkv, out);
    fs::resize_file(fs::path(longer) / "rank-00001.bin", 240);
    REQUIRE_THROWS_WITH(CheckpointReader(longer),
                        Contains("rank-00001.bin: 240 bytes, expected 120 (a shard of another "
                                 "checkpoint?)"));
  }
  SECTION("fields missing, or of another type, named as such") {
    const auto dir = write_sharded("bad_fields", qkv, out);
    rewrite_index(dir, [](nlohmann::json& j) { j.erase("format"); });
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("format: required field is missing"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["format"] = "dtexec-checkpoint-2";
      j["plan"]["clip_grad"] = "1";
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("plan.clip_grad: expected a number >= 0"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["plan"].erase("clip_grad");
      j["losses"] = {"5.5", 5.25};
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("losses[0]: expected a cross-entropy (a finite number >= 0), got "
                                 "\"5.5\""));
    rewrite_index(dir, [](nlohmann::json& j) { j["losses"] = {5.5, -5.25}; });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("losses[1]: expected a cross-entropy (a finite number >= 0), got "
                                 "-5.25"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["losses"] = {5.5, 5.25};
      j["shards"][0]["pieces"] = "none";
    });
    REQUIRE_THROWS_WITH(
        CheckpointReader(dir),
        Contains("shards: rank-00000.bin: pieces: expected an array, got \"none\""));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["shards"][0]["pieces"] = nlohmann::json::array();
      j["learning_rate"] = "fast";
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("learning_rate: expected a positive number"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["learning_rate"] = 1e-3;
      j["weight_decay"] = -1;
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("weight_decay: expected a number >= 0"));
    rewrite_index(dir, [](nlohmann::json& j) {
      j["weight_decay"] = 0;
      j["bogus"] = 1;
    });
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("bogus: unknown field"));
    rewrite_index(dir, [](nlohmann::json& j) { j.erase("bogus"); });
    rewrite_index(dir, [](nlohmann::json& j) { j = nlohmann::json::array({1, 2}); });
    REQUIRE_THROWS_WITH(CheckpointReader(dir),
                        Contains("checkpoint.json: expected a JSON object, got an array"));
  }
  SECTION("checkpoint.json a folder") {
    const std::string dir = folder("bad_index_folder");
    fs::create_directories(fs::path(dir) / "checkpoint.json");
    REQUIRE_THROWS_WITH(CheckpointReader(dir), Contains("is a directory; expected a JSON file"));
  }
  SECTION("a shard that the writer cannot see (a folder not every rank shares)") {
    const std::string dir = folder("bad_unshared");
    dtsim::exec::begin_checkpoint(dir);
    ShardWriter shard(dir, 3);
    add_piece(shard, out, dtsim::exec::whole(4, 3), 0, 12);
    const auto index = shard.close();
    fs::remove(fs::path(dir + ".tmp") / "rank-00003.bin");
    REQUIRE_THROWS_WITH(dtsim::exec::finish_checkpoint(dir, info(), {index}),
                        Contains("rank-00003.bin: a rank's shard is missing (144 bytes expected): "
                                 "is " +
                                 dir + " on a file system that every rank sees?"));
  }
}

TEST_CASE("checkpoint: compare reads one tensor of each at a time, whatever the shards",
          "[exec][checkpoint]") {
  const auto qkv = numbered("L0.qkv.weight", 4, 6);
  const auto out = numbered("L0.out.weight", 4, 3);
  const std::string sharded = write_sharded("compare_sharded", qkv, out);
  Checkpoint whole_one;
  static_cast<dtsim::exec::CheckpointInfo&>(whole_one) = info();
  whole_one.tensors = {out, qkv};  // another order
  whole_one.tensors[1].data[7] += 0.25f;
  const std::string single = folder("compare_whole");
  dtsim::exec::write_checkpoint(single, whole_one);
  const auto d =
      dtsim::exec::compare_checkpoints(CheckpointReader(sharded), CheckpointReader(single));
  CHECK(d.problems.empty());
  CHECK(d.steps_compared == 2);
  CHECK(d.max_loss_diff == 0);
  CHECK(d.max_weight_diff == Approx(0.25));
  CHECK(d.worst_tensor == "L0.qkv.weight");
  // The same answer as comparing the checkpoints read whole.
  const auto whole_diff = dtsim::exec::compare_checkpoints(dtsim::exec::read_checkpoint(sharded),
                                                           dtsim::exec::read_checkpoint(single));
  CHECK(whole_diff.max_weight_diff == d.max_weight_diff);
  CHECK(whole_diff.worst_tensor == d.worst_tensor);
}

TEST_CASE("checkpoint: compare refuses what resuming refuses", "[exec][checkpoint]") {
  // A weight that is not finite, a negative second moment, an lr_schedule that is not one:
  // bad input (exit 2), not a difference (a NaN compared with itself read as DIFFERENT, a
  // negative moment as equal).
  const auto qkv = numbered("L0.qkv.weight", 4, 6);
  const auto write = [&](const std::string& name, const std::function<void(Checkpoint&)>& edit) {
    Checkpoint c;
    static_cast<dtsim::exec::CheckpointInfo&>(c) = info();
    c.tensors = {qkv};
    edit(c);
    const std::string dir = folder(name);
    dtsim::exec::write_checkpoint(dir, c);
    return dir;
  };
  const std::string nan = write("compare_nan", [](Checkpoint& c) {
    c.tensors[0].data[5] = std::numeric_limits<float>::quiet_NaN();
  });
  const std::string negative =
      write("compare_negative_v", [](Checkpoint& c) { c.tensors[0].v[3] = -1; });
  for (const auto& dir : {nan, negative}) {
    INFO(dir);
    REQUIRE_THROWS_WITH(
        dtsim::exec::compare_checkpoints(CheckpointReader(dir), CheckpointReader(dir)),
        Catch::Matchers::Contains(dir + ": tensors: L0.qkv.weight: a weight or AdamW moment that "
                                        "is not finite, or a negative second moment"));
  }
  const std::string schedule = write("compare_schedule", [](Checkpoint&) {});
  rewrite_index(schedule, [](nlohmann::json& j) { j["lr_schedule"] = 5; });
  REQUIRE_THROWS_WITH(CheckpointReader(schedule), Catch::Matchers::Contains("lr_schedule") &&
                                                      Catch::Matchers::Contains("checkpoint.json"));
}

TEST_CASE("checkpoint: a slice of another split read from the pieces that hold it",
          "[exec][checkpoint]") {
  const auto qkv = numbered("L0.qkv.weight", 4, 6);
  const auto out = numbered("L0.out.weight", 4, 3);
  const CheckpointReader reader(write_sharded("slices", qkv, out));
  // Written as tp 2 by column ranges (qkv) and rows (out), each split again in two dp ranges;
  // read as other plans would hold them: rows, several column ranges, one column, the whole.
  const std::vector<std::pair<const CheckpointTensor*, Slice>> wants = {
      {&qkv, Slice{4, 6, 1, 2, {{0, 6}}}},
      {&qkv, Slice{4, 6, 0, 4, {{0, 2}, {3, 1}, {5, 1}}}},
      {&qkv, Slice{4, 6, 2, 2, {{4, 1}}}},
      {&out, Slice{4, 3, 0, 4, {{1, 2}}}},
      {&out, dtsim::exec::whole(4, 3)}};
  for (const auto& [full, want] : wants) {
    const auto t = reader.read_slice(full->name, want);
    REQUIRE(static_cast<std::int64_t>(t.data.size()) == want.local_size());
    for (std::int64_t i = 0; i < want.local_size(); ++i) {
      const auto at = static_cast<std::size_t>(want.full_index(i));
      const auto k = static_cast<std::size_t>(i);
      INFO(full->name << " element " << i);
      CHECK(t.data[k] == full->data[at]);
      CHECK(t.m[k] == full->m[at]);
      CHECK(t.v[k] == full->v[at]);
    }
  }
}

TEST_CASE("checkpoint: a slice reads only the pieces whose rows it needs", "[exec][checkpoint]") {
  // A [4, 3] tensor written as ZeRO over dp 4 would: each rank a flat range of the whole
  // tensor, one row each. Read as tp 2's first row-parallel slice (rows 0-1), the shards of
  // rows 2 and 3 are not read: gone after the index is read, the slice still comes back.
  const auto out = numbered("L0.out.weight", 4, 3);
  const std::string dir = folder("rows_only");
  dtsim::exec::begin_checkpoint(dir);
  std::vector<nlohmann::json> indices;
  for (int d = 0; d < 4; ++d) {
    ShardWriter shard(dir, d);
    add_piece(shard, out, dtsim::exec::whole(4, 3), 3 * d, 3);
    indices.push_back(shard.close());
  }
  dtsim::exec::finish_checkpoint(dir, info(), indices);
  const CheckpointReader reader(dir);
  fs::remove(fs::path(dir) / "rank-00002.bin");
  fs::remove(fs::path(dir) / "rank-00003.bin");
  const Slice top{4, 3, 0, 2, {{0, 3}}};
  const auto t = reader.read_slice("L0.out.weight", top);
  CHECK(t.data == std::vector<float>(out.data.begin(), out.data.begin() + 6));
  CHECK(t.v == std::vector<float>(out.v.begin(), out.v.begin() + 6));
  REQUIRE_THROWS_WITH(reader.read("L0.out.weight"),
                      Catch::Contains("rank-00002.bin: cannot read L0.out.weight's piece"));
}

TEST_CASE("checkpoint: only a checkpoint writer's folders are replaced", "[exec][checkpoint]") {
  using Catch::Contains;
  using dtsim::exec::check_checkpoint_folder;
  using dtsim::exec::checkpoint_folder;
  SECTION("the path names a folder of its own") {
    CHECK(checkpoint_folder("ck/", "--checkpoint") == "ck");
    CHECK(checkpoint_folder("a//b//", "--checkpoint") == "a//b");
    CHECK(checkpoint_folder("/x/ck", "--checkpoint") == "/x/ck");
    for (const char* bad : {"", ".", "..", "/", "a/.."}) {
      REQUIRE_THROWS_WITH(checkpoint_folder(bad, "--checkpoint"),
                          Contains("--checkpoint: expected a folder of its own"));
    }
  }
  Checkpoint c;
  static_cast<dtsim::exec::CheckpointInfo&>(c) = info();
  c.tensors = {numbered("a.weight", 2, 3)};
  SECTION("a folder with a user's file, a file, or a .tmp or .old of others is refused") {
    const std::string dir = folder("user");
    fs::create_directories(dir);
    std::ofstream(fs::path(dir) / "notes.txt") << "mine";
    REQUIRE_THROWS_WITH(check_checkpoint_folder(dir, "--checkpoint"),
                        Contains("exists and is not a dtexec checkpoint folder"));
    // The library refuses it too, whoever calls it, and leaves it as it was.
    REQUIRE_THROWS_AS(dtsim::exec::write_checkpoint(dir, c), dtsim::InputError);
    CHECK(fs::exists(fs::path(dir) / "notes.txt"));
    fs::remove_all(dir);
    std::ofstream(dir) << "a file";
    REQUIRE_THROWS_WITH(check_checkpoint_folder(dir, "--checkpoint"),
                        Contains("exists and is not a dtexec checkpoint folder"));
    fs::remove(dir);
    fs::create_directories(dir + ".old/sub");
    REQUIRE_THROWS_WITH(check_checkpoint_folder(dir, "--checkpoint"),
                        Contains(dir + ".old exists and is not a dtexec checkpoint folder"));
    REQUIRE_THROWS_AS(dtsim::exec::write_checkpoint(dir, c), dtsim::InputError);
    CHECK(fs::exists(dir + ".old/sub"));
    fs::remove_all(dir + ".old");
  }
  SECTION("an earlier checkpoint, an empty folder, or a missing one is fine") {
    const std::string dir = folder("ours");
    check_checkpoint_folder(dir, "--checkpoint");
    CHECK_FALSE(fs::exists(dir + ".tmp"));  // the probe leaves nothing behind
    fs::create_directories(dir);
    check_checkpoint_folder(dir, "--checkpoint");
    dtsim::exec::write_checkpoint(dir, c);
    check_checkpoint_folder(dir, "--checkpoint");
    dtsim::exec::write_checkpoint(dir, c);
    CHECK(dtsim::exec::read_checkpoint(dir).step == 2);
  }
  SECTION("a user's DIR.tmp, and a link to a checkpoint (renaming it would keep the old one)") {
    const std::string dir = folder("links");
    fs::create_directories(dir + ".tmp");
    std::ofstream(fs::path(dir + ".tmp") / "draft.txt") << "mine";
    REQUIRE_THROWS_WITH(check_checkpoint_folder(dir, "--checkpoint"),
                        Contains(dir + ".tmp exists and is not a dtexec checkpoint folder"));
    fs::remove_all(dir + ".tmp");
    const std::string real = folder("links_real");
    dtsim::exec::write_checkpoint(real, c);
    fs::create_directory_symlink(real, dir);
    REQUIRE_THROWS_WITH(check_checkpoint_folder(dir, "--checkpoint"),
                        Contains("is a symbolic link; give the folder it points to (" + real));
    fs::remove(dir);
  }
  SECTION("a folder given with a trailing '/' has its DIR.old beside it") {
    const std::string dir = folder("slash_old");
    dtsim::exec::write_checkpoint(dir, c);
    fs::rename(dir, dir + ".old");  // a writer stopped between its two renames
    CHECK(CheckpointReader(dir + "/").info().step == 2);
    CHECK(CheckpointReader(dir + "//").where() == dir + ".old/checkpoint.json");
  }
  SECTION("a parent folder that is not there") {
    REQUIRE_THROWS_WITH(
        check_checkpoint_folder("/nonexistent-dtsim/ck", "--checkpoint"),
        Contains("--checkpoint /nonexistent-dtsim/ck: no directory /nonexistent-dtsim"));
  }
}

TEST_CASE("checkpoint: what lies in a checkpoint's folders", "[exec][checkpoint]") {
  using dtsim::exec::in_checkpoint_folders;
  const std::string dir = folder("inside");
  fs::create_directories(dir);
  // The folder, DIR.tmp and DIR.old, and what is in them; by any spelling of the path.
  for (const std::string& path :
       {dir, dir + "/checkpoint.json", dir + ".tmp/x.json", dir + ".old/t.json", dir + "//./t.json",
        dir + "/../" + fs::path(dir).filename().string() + "/t.json"}) {
    CHECK(in_checkpoint_folders(dir, path));
  }
  // Given with a trailing slash, its DIR.old is still the folder's (the reader falls back there).
  CHECK(in_checkpoint_folders(dir + "/", dir + ".old/t.json"));
  // A name that only begins like it, and the folder's parent, are not in it.
  for (const std::string& path : {dir + "2/t.json", dir + ".older/t.json", dir + "x",
                                  fs::path(dir).parent_path().string() + "/t.json"}) {
    CHECK_FALSE(in_checkpoint_folders(dir, path));
  }
  // Through a link to the folder.
  const std::string link = folder("inside-link");
  fs::create_directory_symlink(fs::absolute(dir), link);
  CHECK(in_checkpoint_folders(dir, link + "/t.json"));
  fs::remove(link);
}

// Every field of a checkpoint's index replaced, one at a time, by a value of the wrong kind or
// out of range, or removed: reading the checkpoint (every tensor, whole) either works or throws
// an InputError that names the index or the shard it concerns; never another exception (an
// internal error, a failed allocation) nor a crash. (dtsim's own inputs have the same harness,
// tests/cli/input_mutation_test.cpp.)
TEST_CASE("checkpoint: a mutated index is read or refused with its file named",
          "[exec][checkpoint][mutation]") {
  const auto dir =
      write_sharded("mutated", numbered("L0.qkv.weight", 4, 6), numbered("L0.out.weight", 4, 3));
  nlohmann::json base;
  std::ifstream(fs::path(dir) / "checkpoint.json") >> base;
  // (Besides the shared wrong values: a large whole number, and a path out of the folder.)
  const auto mutants = dtsim::test::mutants(base, {std::int64_t{1} << 40, "../rank-00000.bin"});
  int read = 0, refused = 0;
  std::vector<std::string> failures;
  for (const auto& m : mutants) {
    std::ofstream(fs::path(dir) / "checkpoint.json") << m.value.dump(1);
    try {
      (void)dtsim::exec::read_checkpoint(dir);
      ++read;
    } catch (const dtsim::InputError& e) {
      ++refused;
      const std::string what = e.what();
      if (what.find("checkpoint.json") == std::string::npos &&
          what.find(".bin") == std::string::npos) {
        failures.push_back(m.change + ": refused without naming the file: " + what);
      }
    } catch (const std::exception& e) {
      failures.push_back(m.change + ": " + e.what());
    }
  }
  INFO(read << " read, " << refused << " refused; failures:\n"
            << fmt::format("{}", fmt::join(failures, "\n")));
  CHECK(failures.empty());
  CHECK(refused > read);  // the wrong values were read
}

TEST_CASE("checkpoint: architectures differ in the fields both recorded", "[exec][checkpoint]") {
  using dtsim::exec::architecture_differences;
  const nlohmann::json a = {{"layers", 2}, {"rope_theta", 500000}, {"moe", nullptr}};
  nlohmann::json b = a;
  b["rope_theta"] = 500000.0;  // (the same number, written another way)
  CHECK(architecture_differences(a, b).empty());
  CHECK(architecture_differences(nullptr, b).empty());  // (a checkpoint from before)
  b["qk_norm"] = true;  // a field a later version records: no difference
  CHECK(architecture_differences(a, b).empty());
  b["moe"] = {{"experts", 4}, {"top_k", 2}};
  b["layers"] = 3;
  const auto differ = architecture_differences(a, b);
  REQUIRE(differ.size() == 3);
  CHECK(differ[0] == "layers 2 against 3");
  CHECK(differ[1] == "moe.experts null against 4");
  CHECK(differ[2] == "moe.top_k null against 2");
  // A mixture recorded before its shared experts and gates were (none, and renormalized over
  // the top k): the same as a model that says so, another than one that has either.
  const nlohmann::json before = {{"moe", {{"experts", 4}, {"top_k", 2}}}};
  nlohmann::json now = before;
  now["moe"]["shared_ffn_hidden"] = 0;
  now["moe"]["normalize_top_k"] = true;
  CHECK(architecture_differences(before, now).empty());
  now["moe"]["normalize_top_k"] = false;
  now["moe"]["shared_ffn_hidden"] = 128;
  CHECK(architecture_differences(before, now) ==
        std::vector<std::string>{"moe.normalize_top_k true against false",
                                 "moe.shared_ffn_hidden 0 against 128"});
  // Sigmoid scores and their scale: softmax at 1 before they were recorded.
  now = before;
  now["moe"]["scores"] = "softmax";
  now["moe"]["routed_scaling_factor"] = 1.0;
  CHECK(architecture_differences(before, now).empty());
  now["moe"]["scores"] = "sigmoid";
  now["moe"]["routed_scaling_factor"] = 2.5;
  CHECK(architecture_differences(before, now) ==
        std::vector<std::string>{"moe.routed_scaling_factor 1.0 against 2.5",
                                 "moe.scores \"softmax\" against \"sigmoid\""});
  // Dense blocks among the experts': none before they were recorded; a list compared whole.
  now = before;
  now["moe"]["dense_blocks"] = nlohmann::json::array();
  now["moe"]["dense_ffn_hidden"] = 0;
  CHECK(architecture_differences(before, now).empty());
  now["moe"]["dense_blocks"] = {0, 2};
  now["moe"]["dense_ffn_hidden"] = 256;
  CHECK(architecture_differences(before, now) ==
        std::vector<std::string>{"moe.dense_blocks [] against [0,2]",
                                 "moe.dense_ffn_hidden 0 against 256"});
}
