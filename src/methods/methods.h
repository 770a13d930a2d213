// The rows of the method table: one factory function per method file.
#pragma once

#include "kvq/spec.h"

namespace kvq {

MethodDef make_fp16_method();
MethodDef make_kivi_method();
MethodDef make_cachegen_method();
MethodDef make_xquant_method();
MethodDef make_zipcache_method();

}  // namespace kvq
