#include "instance_tables.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace fmha::detail {
namespace {

int pipeline_rank(const char* token) {
  for (int i = 0; i < kNumPipelines; ++i) {
    if (std::strcmp(kPipelineTokens[i], token) == 0) return i;
  }
  return kNumPipelines;  // a pipeline this build does not know: after every known one
}

bool stores_lse(const FwdInstanceEntry& e) { return e.traits.lse; }
bool stores_lse(const BwdInstanceEntry&) { return false; }
bool stores_lse(const KvcacheInstanceEntry&) { return false; }

// generator/dispatch.py's PREFERENCE, criterion by criterion; the name last, as there.
template <class Entry>
bool preferred_entry(const Entry& a, const Entry& b) {
  auto key = [](const Entry& e) {
    return std::make_tuple(-e.arch_cc, !e.arch_exact, pipeline_rank(e.pipeline), e.pad_seqlen,
                           e.pad_hdim, e.pad_hdim ? e.traits.hdim_q : 0,
                           e.pad_hdim ? e.traits.hdim_v : 0, stores_lse(e),
                           -e.block_m * e.block_n);
  };
  const auto ka = key(a), kb = key(b);
  if (ka != kb) return ka < kb;
  return std::strcmp(a.name, b.name) < 0;
}

// Where each added entry came from, by name (names are unique across operations).
std::mutex origins_mutex;
std::unordered_map<std::string, std::string>& origins() {
  static std::unordered_map<std::string, std::string> map;
  return map;
}
void record_origin(const char* name, const std::string& origin) {
  std::lock_guard<std::mutex> lock(origins_mutex);
  origins()[name] = origin;
}

// One operation's list. Readers take the current generation without a lock; a load copies it,
// adds its entries and publishes the copy. Every generation is kept: a reader may still walk an
// older one, and loads are few (one per instance compiled on demand).
template <class Entry>
class Table {
 public:
  Table(const Entry* rows, int count) { publish(std::vector<Entry>(rows, rows + count)); }

  EntryList<Entry> list() const {
    const auto* rows = current_.load(std::memory_order_acquire);
    return {rows->data(), static_cast<int>(rows->size())};
  }

  int add(const Entry* entries, int count, const std::string& origin) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Entry> rows = *current_.load(std::memory_order_relaxed);
    int added = 0;
    for (int i = 0; i < count; ++i) {
      const Entry& e = entries[i];
      const bool known = std::any_of(rows.begin(), rows.end(), [&](const Entry& row) {
        return std::strcmp(row.name, e.name) == 0;
      });
      if (known) continue;
      const auto place = std::upper_bound(rows.begin(), rows.end(), e, [](const Entry& x,
                                                                         const Entry& y) {
        return preferred_entry(x, y);
      });
      rows.insert(place, e);
      record_origin(e.name, origin);
      ++added;
    }
    if (added > 0) publish(std::move(rows));
    return added;
  }

 private:
  void publish(std::vector<Entry> rows) {
    generations_.push_back(std::make_unique<const std::vector<Entry>>(std::move(rows)));
    current_.store(generations_.back().get(), std::memory_order_release);
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<const std::vector<Entry>>> generations_;
  std::atomic<const std::vector<Entry>*> current_{nullptr};
};

Table<FwdInstanceEntry>& fwd_table() {
  static Table<FwdInstanceEntry> table(kFwdInstances, kNumFwdInstances);
  return table;
}
Table<BwdInstanceEntry>& bwd_table() {
  static Table<BwdInstanceEntry> table(kBwdInstances, kNumBwdInstances);
  return table;
}
Table<KvcacheInstanceEntry>& kvcache_table() {
  static Table<KvcacheInstanceEntry> table(kKvcacheInstances, kNumKvcacheInstances);
  return table;
}

}  // namespace

EntryList<FwdInstanceEntry> fwd_entries() { return fwd_table().list(); }
EntryList<BwdInstanceEntry> bwd_entries() { return bwd_table().list(); }
EntryList<KvcacheInstanceEntry> kvcache_entries() { return kvcache_table().list(); }

bool preferred(const FwdInstanceEntry& a, const FwdInstanceEntry& b) {
  return preferred_entry(a, b);
}
bool preferred(const BwdInstanceEntry& a, const BwdInstanceEntry& b) {
  return preferred_entry(a, b);
}
bool preferred(const KvcacheInstanceEntry& a, const KvcacheInstanceEntry& b) {
  return preferred_entry(a, b);
}

int add_entries(const FwdInstanceEntry* entries, int count, const std::string& origin) {
  return fwd_table().add(entries, count, origin);
}
int add_entries(const BwdInstanceEntry* entries, int count, const std::string& origin) {
  return bwd_table().add(entries, count, origin);
}
int add_entries(const KvcacheInstanceEntry* entries, int count, const std::string& origin) {
  return kvcache_table().add(entries, count, origin);
}

std::string origin_of(const char* name) {
  std::lock_guard<std::mutex> lock(origins_mutex);
  const auto found = origins().find(name);
  return found == origins().end() ? std::string() : found->second;
}

}  // namespace fmha::detail
