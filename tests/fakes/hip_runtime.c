/* A fake libamdhip64: the HIP host-memory calls hisparse makes, with HIP's rules.
 *
 * Built by tests/fakes/hip_runtime.py into a shared library named libamdhip64.so, loaded
 * before the ROCm backend looks for the runtime, so the backend finds it by name and calls
 * it through ctypes exactly as it calls the real one. Prototypes, flag values and error
 * codes are those of ROCm's hip_runtime_api.h / hip_runtime_api.h's hipError_t.
 */
#include <stddef.h>
#include <stdint.h>

#define hipSuccess 0
#define hipErrorInvalidValue 1
#define hipErrorOutOfMemory 2
#define hipErrorHostMemoryAlreadyRegistered 712
#define hipErrorHostMemoryNotRegistered 713

#define hipHostRegisterPortable 0x1
#define hipHostRegisterMapped 0x2
#define hipHostRegisterIoMemory 0x4
#define hipHostRegisterReadOnly 0x8
#define VALID_REGISTER_FLAGS \
    (hipHostRegisterPortable | hipHostRegisterMapped | hipHostRegisterIoMemory | \
     hipHostRegisterReadOnly)

/* Device addresses of mapped host memory: host address + this (differs on purpose). */
#define DEVICE_OFFSET 0x7f0000000000ULL
#define MAX_REGISTRATIONS 256

struct registration {
    uintptr_t base;
    size_t size;
    unsigned int flags;
};

static struct registration registrations[MAX_REGISTRATIONS];
static int last_error = hipSuccess;

/* What a test reads back (ctypes c_int.in_dll) or sets. */
int fake_registrations = 0;
int fake_register_calls = 0;
int fake_unregister_calls = 0;
int fake_device_pointer_calls = 0;
int fake_get_last_error_calls = 0;
int fake_fail_next_register = 0; /* an error code the next hipHostRegister returns */

static int fail(int error) {
    last_error = error;
    return error;
}

void fake_reset(void) {
    fake_registrations = fake_register_calls = fake_unregister_calls = 0;
    fake_device_pointer_calls = fake_get_last_error_calls = fake_fail_next_register = 0;
    last_error = hipSuccess;
}

/* The registration's base, size and flags (for i < fake_registrations). */
uintptr_t fake_registration_base(int i) { return registrations[i].base; }
size_t fake_registration_size(int i) { return registrations[i].size; }
unsigned int fake_registration_flags(int i) { return registrations[i].flags; }

static int find(uintptr_t address) {
    for (int i = 0; i < fake_registrations; ++i) {
        if (registrations[i].base <= address &&
            address < registrations[i].base + registrations[i].size) {
            return i;
        }
    }
    return -1;
}

int hipHostRegister(void *host, size_t size, unsigned int flags) {
    uintptr_t base = (uintptr_t)host;
    ++fake_register_calls;
    if (fake_fail_next_register) {
        int error = fake_fail_next_register;
        fake_fail_next_register = 0;
        return fail(error);
    }
    if (host == NULL || size == 0 || (flags & ~VALID_REGISTER_FLAGS) != 0) {
        return fail(hipErrorInvalidValue);
    }
    for (int i = 0; i < fake_registrations; ++i) {
        if (base < registrations[i].base + registrations[i].size &&
            registrations[i].base < base + size) {
            return fail(hipErrorHostMemoryAlreadyRegistered);
        }
    }
    if (fake_registrations == MAX_REGISTRATIONS) {
        return fail(hipErrorOutOfMemory);
    }
    registrations[fake_registrations].base = base;
    registrations[fake_registrations].size = size;
    registrations[fake_registrations].flags = flags;
    ++fake_registrations;
    return hipSuccess;
}

int hipHostUnregister(void *host) {
    ++fake_unregister_calls;
    for (int i = 0; i < fake_registrations; ++i) {
        if (registrations[i].base == (uintptr_t)host) { /* the exact base, as HIP wants */
            registrations[i] = registrations[--fake_registrations];
            return hipSuccess;
        }
    }
    return fail(hipErrorHostMemoryNotRegistered);
}

int hipHostGetDevicePointer(void **device, void *host, unsigned int flags) {
    ++fake_device_pointer_calls;
    int i = find((uintptr_t)host);
    if (device == NULL || flags != 0 || i < 0 ||
        !(registrations[i].flags & hipHostRegisterMapped)) {
        return fail(hipErrorInvalidValue);
    }
    *device = (void *)((uintptr_t)host + DEVICE_OFFSET);
    return hipSuccess;
}

int hipGetLastError(void) {
    int error = last_error;
    ++fake_get_last_error_calls;
    last_error = hipSuccess;
    return error;
}

const char *hipGetErrorString(int error) {
    switch (error) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorHostMemoryAlreadyRegistered: return "hipErrorHostMemoryAlreadyRegistered";
    case hipErrorHostMemoryNotRegistered: return "hipErrorHostMemoryNotRegistered";
    default: return "hipErrorUnknown";
    }
}
