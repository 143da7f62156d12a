// What the emulated NVRTC (nvrtc.cpp) hands back as PTX, and all the
// emulated driver (driver.cpp) accepts as a module.
#pragma once
#define EMU_PTX_MARK "// fathom cuda-emu: no PTX; the kernels run on the host emulator\n"
