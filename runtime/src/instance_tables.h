// The instance tables the dispatcher reads, one per operation: the table the generator rendered
// into this build (fmha/registry.h), merged with the entries loaded later from shared objects
// of instances compiled on demand (fmha::load_instances). A loaded entry takes the place the
// generator's order of preference gives it (generator/dispatch.py's PREFERENCE, which
// `preferred` mirrors), the place a build with every instance would have given it, so it never
// shadows a better built-in instance.
#pragma once

#include <string>

#include "fmha/registry.h"

namespace fmha::detail {

// One operation's entries in the order of preference, as of the call that returned it: a
// later load publishes a new list and leaves this one valid for the life of the process.
template <class Entry>
struct EntryList {
  const Entry* rows = nullptr;
  int size = 0;
  const Entry* begin() const { return rows; }
  const Entry* end() const { return rows + size; }
};

EntryList<FwdInstanceEntry> fwd_entries();
EntryList<BwdInstanceEntry> bwd_entries();
EntryList<KvcacheInstanceEntry> kvcache_entries();

// Whether `a` goes before `b` in the order of preference.
bool preferred(const FwdInstanceEntry& a, const FwdInstanceEntry& b);
bool preferred(const BwdInstanceEntry& a, const BwdInstanceEntry& b);
bool preferred(const KvcacheInstanceEntry& a, const KvcacheInstanceEntry& b);

// Adds `count` entries of one operation to its list, each at its place in the order of
// preference; an entry whose name the list already has is left out (a second load of one
// shared object, or an instance this build has). Returns how many were added. The entries'
// memory (their names and functions) must outlive the process: shared objects stay loaded.
// `origin`: the shared object the entries come from (origin_of).
int add_entries(const FwdInstanceEntry* entries, int count, const std::string& origin);
int add_entries(const BwdInstanceEntry* entries, int count, const std::string& origin);
int add_entries(const KvcacheInstanceEntry* entries, int count, const std::string& origin);

// The shared object an added entry came from; "" for the build's own.
std::string origin_of(const char* name);

}  // namespace fmha::detail
