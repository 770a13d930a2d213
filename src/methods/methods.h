// The rows of the method table: one factory function per method file (src/methods/<name>.cc),
// listed once in src/methods/registry.cc.
#pragma once

#include "cache/codec.h"
#include "kvq/spec.h"

namespace kvq {

MethodDef make_fp16_method();
MethodDef make_kivi_method();
MethodDef make_cachegen_method();
MethodDef make_xquant_method();
MethodDef make_zipcache_method();

}  // namespace kvq
