//! A KDA layer's core on the device (`kda.cu`), and the sequences' states
//! it leaves there: named by their host copies' address and length,
//! copied back or copied on the device when the owner asks, dropped by
//! `forget`.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg, result};
use fathom_kernels::kda::KdaJob;
use fathom_kernels::state_buf::{StateBuf, StateKey};

use fathom_kernels::backend::{MatRef, segments};

use super::queue::{grow, key, make_room, pinned};
use super::{CudaBackend, Resident, State};
use crate::CudaError;
use crate::cache::{Class, Key};

/// The longest convolution `kda.cu` carries (`KDA_MAX_KERNEL`).
const MAX_KERNEL: usize = 8;

impl CudaBackend {
    /// Runs `job` in one round trip: its inputs go up in one copy, the
    /// layer's parameters are kept with the weights (copied up on first
    /// use; their owner forgets them when it drops them), each sequence's states are copied up unless their
    /// newest copies are here already, one launch per sequence (a block per
    /// head), the outputs back with one synchronisation. `Ok(false)` when
    /// declined: a shape the kernel does not take, or the decay without a
    /// lower bound (its softplus has no device twin yet).
    pub(super) fn kda(&self, job: &mut KdaJob<'_>) -> Result<bool, CudaError> {
        let d = job.dims;
        let (h, kd, kernel) = (d.heads, d.head_dim, d.conv_kernel);
        let Some(lb) = d.gate_lower_bound else {
            return Ok(false);
        };
        let p = h * kd;
        let n = job.seqs.last().map_or(0, |s| s.rows.end);
        let w = &job.w;
        let sizes_ok = (1..=1024).contains(&kd)
            && (2..=MAX_KERNEL).contains(&kernel)
            && h > 0
            && n > 0
            && job.out.len() == n * p
            && job
                .x
                .pre
                .iter()
                .chain([&job.x.f, &job.x.g])
                .all(|v| v.len() == n * p)
            && job.x.b.len() == n * h
            && w.conv.iter().all(|t| t.len() == p * kernel)
            && w.a.len() == p
            && w.dt_bias.len() == p
            && w.o_norm.len() == kd
            && job
                .inputs_out
                .as_ref()
                .is_none_or(|b| b.len() == KdaJob::inputs_len(d, n))
            && job.seqs.iter().all(|s| {
                s.s.len() == h * kd * kd && s.conv.iter().all(|c| c.len() == (kernel - 1) * p)
            });
        if !sizes_ok {
            return Ok(false);
        }
        let mut st = self.lock();
        let st = &mut *st;
        let r = self.kda_queue(st, job, lb);
        let synced = self.stream.synchronize();
        if r.is_err() || synced.is_err() {
            // Copies made for this job hold nothing its owners will ask for.
            for s in &job.seqs {
                if s.s.host().is_some() {
                    st.states.remove(&s.s.key());
                }
                for c in s.conv.iter().filter(|c| c.host().is_some()) {
                    st.states.remove(&c.key());
                }
            }
            r?;
            synced?;
        }
        let hy = st.hy.as_ref().expect("staged").as_slice()?;
        job.out.copy_from_slice(&hy[..n * p]);
        if let Some(buf) = job.inputs_out.as_deref_mut() {
            buf.copy_from_slice(&hy[n * p..n * p + buf.len()]);
        }
        for s in job.seqs.iter_mut() {
            s.s.set_on_device();
            s.conv.iter_mut().for_each(|c| c.set_on_device());
        }
        st.stats.vram_state_bytes = st.states.values().map(|s| 4 * s.len() as u64).sum();
        Ok(true)
    }

    /// Queues `job`'s copies, launches and result copy.
    fn kda_queue(&self, st: &mut State, job: &KdaJob<'_>, lb: f32) -> Result<(), CudaError> {
        let d = job.dims;
        let (h, kd, kernel) = (d.heads, d.head_dim, d.conv_kernel);
        let p = h * kd;
        let n = job.out.len() / p;
        let (x, w) = (&job.x, &job.w);
        let params = [w.conv[0], w.conv[1], w.conv[2], w.a, w.dt_bias, w.o_norm];
        let pp = self.params_here(st, &params)?;
        let parts: [&[f32]; 6] = [x.pre[0], x.pre[1], x.pre[2], x.f, x.b, x.g];
        let total: usize = parts.iter().map(|v| v.len()).sum();
        let ctx = self.stream.context();
        let hx = pinned(ctx, &mut st.hx, total)?.as_mut_slice()?;
        let mut offs = Vec::with_capacity(parts.len());
        let mut off = 0;
        for v in parts {
            offs.push(off);
            hx[off..off + v.len()].copy_from_slice(v);
            off += v.len();
        }
        let ny = n * p + job.inputs_out.as_ref().map_or(0, |b| b.len());
        pinned(ctx, &mut st.hy, ny)?;
        let xp = grow(&self.stream, &mut st.x, total)?
            .device_ptr(&self.stream)
            .0;
        let yp = grow(&self.stream, &mut st.y, ny)?
            .device_ptr(&self.stream)
            .0;
        let hin = if ny > n * p {
            yp + 4 * (n * p) as u64
        } else {
            0
        };
        let n_rows = n as i32;
        let cu = self.stream.cu_stream();
        let hx = st.hx.as_ref().expect("staged").as_slice()?;
        // SAFETY: the device buffer holds at least `total` values; `hx` is
        // page-locked and not written again before the synchronisation.
        unsafe { result::memcpy_htod_async(xp, &hx[..total], cu) }?;
        st.stats.h2d_bytes += 4 * total as u64;
        let at = |i: usize| {
            if i < parts.len() {
                xp + 4 * offs[i] as u64
            } else {
                pp[i - parts.len()]
            }
        };
        for seq in &job.seqs {
            let bufs: [&StateBuf; 4] = [&*seq.s, &*seq.conv[0], &*seq.conv[1], &*seq.conv[2]];
            let mut ptrs = [0u64; 4];
            for (ptr, buf) in ptrs.iter_mut().zip(bufs) {
                *ptr = self.state_here(st, buf)?;
            }
            let (row0, t) = (seq.rows.start as i32, seq.rows.len() as i32);
            let (hi, kdi, ki) = (h as i32, kd as i32, kernel as i32);
            let (q_scale, l2, eps) = (d.q_scale(), fathom_kernels::kda::KDA_L2_EPS, d.norm_eps);
            let args: [u64; 16] = [
                ptrs[0],
                ptrs[1],
                ptrs[2],
                ptrs[3],
                at(0),
                at(1),
                at(2),
                at(3),
                at(4),
                at(5),
                at(6),
                at(7),
                at(8),
                at(9),
                at(10),
                at(11),
            ];
            let mut b = self.stream.launch_builder(&self.funcs.kda);
            for a in &args {
                b.arg(a);
            }
            b.arg(&yp).arg(&row0).arg(&t).arg(&hi).arg(&kdi).arg(&ki);
            b.arg(&q_scale)
                .arg(&l2)
                .arg(&eps)
                .arg(&lb)
                .arg(&hin)
                .arg(&n_rows);
            let cfg = LaunchConfig {
                grid_dim: (h as u32, 1, 1),
                block_dim: (kd as u32, 1, 1),
                shared_mem_bytes: (4 * (4 * kd + 2)) as u32,
            };
            // SAFETY: the arguments match `kda_step` in `kda.cu`: device
            // copies of the sequence's states and of the staged inputs, sized
            // as `kda` checked; `kd` ≤ 1024 threads, `kernel` ≤ KDA_MAX_KERNEL.
            unsafe { b.launch(cfg) }?;
        }
        st.stats.device_calls += 1;
        let hy = st.hy.as_mut().expect("staged").as_mut_slice()?;
        // SAFETY: the device buffer holds ny values written by the kernels
        // on this stream; `hy` is page-locked and read after the synchronisation.
        unsafe { result::memcpy_dtoh_async(&mut hy[..ny], yp, cu) }?;
        st.stats.d2h_bytes += 4 * ny as u64;
        Ok(())
    }

    /// The device addresses of a layer's parameters, each kept like a
    /// weight (copied up on the compute stream the first time, so the
    /// launches after it see it).
    fn params_here(&self, st: &mut State, params: &[&[f32]; 6]) -> Result<[u64; 6], CudaError> {
        let segs: Vec<&[u8]> = params
            .iter()
            .map(|v| {
                segments(&MatRef::F32 {
                    w: v,
                    rows: 1,
                    cols: v.len(),
                })[0]
            })
            .collect();
        let keys: Vec<Key> = segs.iter().map(|s| key(s)).collect();
        let mut ptrs = [0u64; 6];
        for (i, (seg, k)) in segs.iter().zip(&keys).enumerate() {
            if st.cache.touch(k).is_none() {
                if !make_room(st, seg.len() as u64, &keys, Class::Spine) {
                    return Err(CudaError::Driver(
                        "no room in the weight budget for a KDA layer's parameters".into(),
                    ));
                }
                let buf = self.stream.clone_htod(*seg)?;
                st.stats.h2d_bytes += seg.len() as u64;
                st.cache
                    .insert(*k, Resident { buf, ready: None }, Class::Spine);
            }
            ptrs[i] = st
                .cache
                .get(k)
                .expect("just made")
                .buf
                .device_ptr(&self.stream)
                .0;
        }
        Ok(ptrs)
    }

    /// The device address of `buf`'s copy here, copied up first when its
    /// newest copy is the host's.
    fn state_here(&self, st: &mut State, buf: &StateBuf) -> Result<u64, CudaError> {
        let key = buf.key();
        if let Some(host) = buf.host() {
            let dev = match st.states.remove(&key) {
                Some(mut dev) if dev.len() == host.len() => {
                    self.stream.memcpy_htod(host, &mut dev)?;
                    dev
                }
                _ => self.stream.clone_htod(host)?,
            };
            st.stats.h2d_bytes += 4 * host.len() as u64;
            st.states.insert(key, dev);
        }
        let dev = st.states.get(&key).ok_or_else(|| {
            CudaError::Driver("a sequence's state is marked on the device but is not here".into())
        })?;
        Ok(dev.device_ptr(&self.stream).0)
    }

    pub(super) fn read_state(&self, key: StateKey, out: &mut [f32]) -> Result<(), CudaError> {
        let mut st = self.lock();
        let dev = state_of(&st, key, out.len())?;
        self.stream.memcpy_dtoh(dev, out)?;
        self.stream.synchronize()?;
        st.stats.d2h_bytes += 4 * out.len() as u64;
        Ok(())
    }

    pub(super) fn copy_state(&self, src: StateKey, dst: StateKey) -> Result<(), CudaError> {
        let mut st = self.lock();
        let st = &mut *st;
        let n = src.1 / 4;
        state_of(st, src, n)?;
        let mut to = match st.states.remove(&dst) {
            Some(d) if d.len() == n => d,
            _ => self.stream.alloc_zeros::<f32>(n)?,
        };
        let from = st.states.get(&src).expect("checked");
        self.stream.memcpy_dtod(from, &mut to)?;
        st.states.insert(dst, to);
        st.stats.vram_state_bytes = st.states.values().map(|s| 4 * s.len() as u64).sum();
        Ok(())
    }
}

fn state_of(st: &State, key: StateKey, n: usize) -> Result<&CudaSlice<f32>, CudaError> {
    match st.states.get(&key) {
        Some(d) if d.len() == n => Ok(d),
        _ => Err(CudaError::Driver(format!(
            "no device copy of the state at {:#x} ({n} values)",
            key.0
        ))),
    }
}
