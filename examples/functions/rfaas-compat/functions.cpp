// rFaaS's own example functions, in the form they have in rFaaS
// (github.com/spcl/rFaaS: examples/functions.cpp and
// benchmarks/applications/mpi/mmm-faas.cpp), to show that a function
// written for rFaaS's ABI runs unchanged under rfaas: C linkage,
// uint32_t f(void* args, uint32_t size, void* res), the return value is the
// output length. Only the progress printf of mmm and mmm3 is left out.

#include <cmath>
#include <cstdint>
#include <cstring>

// rFaaS's latency benchmark function: copies the first int of the input and
// claims the whole input size as output.
extern "C" uint32_t empty(void* args, uint32_t size, void* res)
{
  int* src = static_cast<int*>(args), *dest = static_cast<int*>(res);
  *dest = *src;
  return size;
}

// Square matrix product from the input [A | B] (n×n f64 each): adds A·B
// into res, so res must start zeroed.
extern "C" uint32_t mmm(void* args, uint32_t size, void* res)
{
  int n = sqrt(size/(sizeof(double)*2));
  double* A = reinterpret_cast<double*>(args);
  double* B = A + n*n;
  double* C = reinterpret_cast<double*>(res);
  for(int i=0; i<n; i++)
    for(int j=0; j<n; j++)
      for(int k=0; k<n; k++)
        C[i*n+j] += A[i*n+k]*B[k*n+j];
  return size/2;
}

// The same product for the lower half of the rows only (the upper half
// stays on the client); the rest of res is zero.
extern "C" uint32_t mmm3(void* args, uint32_t size, void* res)
{
  int n = sqrt(size/(sizeof(double)*2));
  double* A = reinterpret_cast<double*>(args);
  double* B = A + n*n;
  double* C = reinterpret_cast<double*>(res);
  memset(C, 0, sizeof(double) * n * n);
  int half_n = n/2;
  for(int i=half_n; i<n; i++)
    for(int j=0; j<n; j++)
      for(int k=0; k<n; k++)
        C[i*n+j] += A[i*n+k]*B[k*n+j];
  return size/2;
}
