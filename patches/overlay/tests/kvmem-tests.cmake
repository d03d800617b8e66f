# kvmem-llama: C++ unit tests of the tiering engine (no server; one suite loads a small model): the phase machine, the
# residency rules, the scorers and lexical picks, the selection plan, the undo journal, the host pool, the disk tier, the settings, the
# device scorer and its query rows, the stager's graphs and the captures' readback (on the CPU backend), and the
# recurrent snapshots (on a hybrid model named by KVMEM_TEST_MODEL).
# Built by the CPU engine's build (KVMEM_BUILD_TESTS=ON, included from the top-level CMakeLists.txt), run by ctest;
# kvmem-llama's tests/test_engine_units.py runs ctest.

add_executable(test-kvmem
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-main.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-seq.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-residency.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-score.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-plan.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-pool.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-disk.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-params.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-summaries.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-queries.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-stager.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-readback.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test-kvmem-snapshot.cpp
)
target_include_directories(test-kvmem PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(test-kvmem PRIVATE llama ggml)
target_compile_features(test-kvmem PRIVATE cxx_std_17)

foreach (suite seq residency score lexical plan journal pool disk params summaries queries stager readback snapshot)
    add_test(NAME kvmem-${suite} COMMAND test-kvmem ${suite})
    set_property(TEST kvmem-${suite} PROPERTY LABELS kvmem)
endforeach()

# the stager's stage-in throughput for several staging sizes, and the graph scorer's time with bf16 and f32
# products (benchmarks for a GPU host, not tests: packaging/device/issue24.sh runs them with KVMEM_TEST_DEVICE=CUDA0)
foreach (bench stager score)
    add_executable(bench-kvmem-${bench} ${CMAKE_CURRENT_LIST_DIR}/bench-kvmem-${bench}.cpp)
    target_include_directories(bench-kvmem-${bench} PRIVATE ${PROJECT_SOURCE_DIR}/src)
    target_link_libraries(bench-kvmem-${bench} PRIVATE llama ggml)
    target_compile_features(bench-kvmem-${bench} PRIVATE cxx_std_17)
endforeach()
