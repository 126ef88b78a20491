// fmha::load_instances: a shared object of instances compiled on demand joins the dispatcher.

#include <dlfcn.h>

#include <string>

#include "fmha/fmha.h"
#include "fmha/registry.h"
#include "instance_tables.h"

namespace fmha {

Status load_instances(const std::string& path, int* added) {
  auto invalid = [&](const std::string& why) {
    return Status{Status::Code::kInvalidArgument, "fmha::load_instances(" + path + "): " + why};
  };
  // RTLD_LOCAL: the object's symbols stay its own; only its table is read, through dlsym.
  // Never closed: the dispatcher keeps pointers to its entries' names and functions.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return invalid(error != nullptr ? error : "dlopen failed");
  }
  auto loadable = reinterpret_cast<detail::LoadableFn>(dlsym(handle, detail::kLoadableSymbol));
  if (loadable == nullptr) {
    return invalid(std::string("no ") + detail::kLoadableSymbol +
                   "(): not a shared object of fmha instances");
  }
  const detail::LoadableInstances* table = loadable();
  if (table == nullptr || table->abi != detail::kRegistryAbi) {
    return invalid("compiled against instance-table layout " +
                   std::to_string(table == nullptr ? -1 : table->abi) + ", this library reads " +
                   std::to_string(detail::kRegistryAbi) + "; compile it again");
  }
  const int count = detail::add_entries(table->fwd, table->num_fwd, path) +
                    detail::add_entries(table->bwd, table->num_bwd, path) +
                    detail::add_entries(table->kvcache, table->num_kvcache, path);
  if (added != nullptr) *added = count;
  return Status::Ok();
}

}  // namespace fmha
