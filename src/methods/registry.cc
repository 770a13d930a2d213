// The method table: every compression method kvq knows, in the order `kvq list` prints them.
// Adding a method is one file in src/methods/ and one line here.
#include "methods/methods.h"

namespace kvq {

const std::vector<MethodDef>& method_table() {
  static const std::vector<MethodDef> table = {
      make_fp16_method(),   make_kivi_method(),     make_cachegen_method(),
      make_xquant_method(), make_zipcache_method(),
  };
  return table;
}

const MethodDef* find_method(std::string_view name) { return find_method_in(method_table(), name); }

Result<Spec> parse_spec(std::string_view text) { return parse_spec_in(method_table(), text); }

}  // namespace kvq
