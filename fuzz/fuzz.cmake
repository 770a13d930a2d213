# Fuzz targets. Every fuzz/<name>_fuzz.cc defines LLVMFuzzerTestOneInput (and nothing else that
# needs libFuzzer), so each is built twice:
#  * KVQ_FUZZ=ON (clang): the libFuzzer executable <name>_fuzz, run by scripts/fuzz.sh;
#  * KVQ_BUILD_TESTS=ON: <name>_fuzz_replay, the same entry point with fuzz/replay_main.cc
#    instead of libFuzzer, registered as the ctest test fuzz_replay_<name> that runs the seed
#    corpus fuzz/corpus/<name>/ (and, under KVQ_SANITIZE, does so with ASan and UBSan).
file(GLOB KVQ_FUZZ_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/fuzz/*_fuzz.cc)
if(KVQ_DEV_EXCLUDE)
  list(FILTER KVQ_FUZZ_SOURCES EXCLUDE REGEX "${KVQ_DEV_EXCLUDE}")
endif()
if(NOT KVQ_BUILD_ENGINE)
  set(KVQ_FUZZ_SOURCES)  # the gguf target and the replays link the engine
endif()
foreach(src ${KVQ_FUZZ_SOURCES})
  get_filename_component(name ${src} NAME_WE)
  string(REGEX REPLACE "_fuzz$" "" corpus ${name})
  if(KVQ_FUZZ)
    add_executable(${name} ${src})
    target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/fuzz)
    target_compile_options(${name} PRIVATE ${KVQ_WARNINGS} -fsanitize=fuzzer)
    target_link_options(${name} PRIVATE -fsanitize=fuzzer)
    target_link_libraries(${name} PRIVATE kvq_engine kvq_store)
  endif()
  if(KVQ_BUILD_TESTS)
    add_executable(${name}_replay ${src} ${CMAKE_SOURCE_DIR}/fuzz/replay_main.cc)
    target_include_directories(${name}_replay PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/fuzz)
    target_compile_options(${name}_replay PRIVATE ${KVQ_WARNINGS})
    target_link_libraries(${name}_replay PRIVATE kvq_engine kvq_store)
    add_test(NAME fuzz_replay_${corpus}
             COMMAND ${name}_replay ${CMAKE_SOURCE_DIR}/fuzz/corpus/${corpus})
  endif()
endforeach()
