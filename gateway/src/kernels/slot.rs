//! A slot of the kernel limit, held by a create under way.

use super::{Kernels, LiveKernel};
use std::sync::Arc;

/// A slot of the kernel limit taken by a create under way; given back when dropped
/// unless the kernel was registered in it.
pub(super) struct Slot {
    pub(super) kernels: Arc<Kernels>,
    pub(super) owner: String,
    pub(super) filled: bool,
}

impl Slot {
    /// Registers the kernel in the slot, under the same lock, so the count never dips.
    /// Refused (false) once shutdown began: the final sweep of [`Kernels::shutdown`] takes
    /// the lock after the cancellation, so a kernel registered then would outlive it.
    pub(super) fn fill(mut self, live: &Arc<LiveKernel>) -> bool {
        let mut t = self.kernels.lock();
        t.release(&self.owner);
        self.filled = true;
        if self.kernels.cancel.is_cancelled() {
            return false;
        }
        // A kernel is registered once, so the owner is unset here.
        let _ = live.owner.set(self.owner.clone());
        t.live.insert(live.id().to_owned(), live.clone());
        true
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.filled {
            self.kernels.lock().release(&self.owner);
        }
    }
}
