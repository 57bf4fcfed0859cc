# Cross-building bucketd for aarch64 (arm64) on a Debian amd64 machine with Debian's cross
# compiler and the arm64 -dev packages installed side by side (multiarch); tools/test-aarch64.sh
# sets it all up and runs the tests. By hand:
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=tools/aarch64-toolchain.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
# pkg-config must find the arm64 libraries' .pc files, never the build machine's.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
