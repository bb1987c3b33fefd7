//! The node: every decision the node service makes, held in one value.
//!
//! A [`Node`] ties the [`Inventory`] (who holds which GPU memory) to the [`WindowScheduler`] (who
//! runs now) and adds the life of a vGPU around them:
//!
//! 1. **reserve**: a request (the container's annotations) gets a vGPU id and an assignment
//!    before its container exists (containerd's `Create`, podman's `precreate`);
//! 2. **attach**: the container, once it has an init process, is bound to it and scheduled;
//! 3. **release**: the vGPU's memory is given back and it leaves the scheduler.
//!
//! Meanwhile its container may be **held** (its user paused it: `ctr task pause`, `runc pause`)
//! and released from the hold again (**unhold**): while held it keeps its memory but takes no
//! part in scheduling, and no freeze or thaw order names it (see [`WindowScheduler::hold`]).
//!
//! `register` is reserve and attach at once. A reservation that no container attaches to within
//! `reservation_ttl` lapses. Attaching or registering a container that is already attached
//! returns its vGPU again (the hook may run twice); a failed register leaves nothing behind.
//!
//! The node service does the I/O around it: it reads the socket, finds cgroups, freezes and
//! thaws, and persists the records ([`Node::records`], [`Node::restore`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::accounting::{GpuStats, VgpuStats};
use crate::config::SchedulerConfig;
use crate::inventory::{AssignError, Assignment, Gpu, Inventory, InventoryError};
use crate::policy::{PolicyConfig, PolicyError};
use crate::request::{RequestError, VgpuRequest};
use crate::windows::{Action, BindError, Binding, Decision, WindowScheduler};
use crate::{GpuIndex, Handle, Instant, VgpuId};

/// What a vGPU is attached to: a container and where its processes are.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attachment {
    /// The container's id (or, for `gpuplexctl register`, the id the user chose).
    pub container: String,
    /// How the node service finds the container's cgroups.
    pub target: Target,
}

/// How the node service finds a container's cgroups.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// From this process's `/proc/PID/cgroup` (the container's init).
    Pid(u32),
    /// This cgroup path.
    Cgroup(String),
}

/// One vGPU: what was asked, what was given, and what it is attached to.
#[derive(Clone, Debug, PartialEq)]
pub struct VgpuRecord {
    /// Its id.
    pub id: VgpuId,
    /// The capability its container attaches with (see [`Handle`]).
    pub handle: Handle,
    /// The `gpuplex.io/` annotations it was asked with, as given, and those naming its pod
    /// ([`crate::request::POD_NAME_KEYS`], [`crate::request::POD_NAMESPACE_KEYS`]).
    pub annotations: BTreeMap<String, String>,
    /// The request they make.
    pub request: VgpuRequest,
    /// Its GPUs and memory.
    pub assignment: Assignment,
    /// When it was reserved.
    pub reserved_at: Instant,
    /// Its containers, once attached: one, except for a claim's vGPU, which the containers of
    /// its pod share ([`Node::pin`]); they take its windows together.
    pub attachments: Vec<Attachment>,
    /// The Kubernetes ResourceClaim (its uid) it was pinned for ([`Node::pin`]): the cluster's
    /// scheduler chose its GPUs and memory; it never lapses and is released by its claim.
    pub claim: Option<String>,
    /// The device plugin's units it was allocated for ([`Node::allocate`]), ascending; empty
    /// for any other vGPU. An allocation is pinned under the claim key
    /// [`allocated::allocation_key`].
    pub units: Vec<crate::units::UnitId>,
}

impl VgpuRecord {
    /// Its first container (its only one unless it is a claim's), once attached.
    pub fn attachment(&self) -> Option<&Attachment> {
        self.attachments.first()
    }

    /// Its containers' ids, in the order they attached.
    pub fn containers(&self) -> impl Iterator<Item = &str> {
        self.attachments.iter().map(|a| a.container.as_str())
    }
}

/// How many containers may share one claim's vGPU (the containers of a pod; Kubernetes has no
/// hard limit, but a pod of more is no pod gpuplex can schedule well).
pub const MAX_SHARING: usize = 32;

/// Which vGPU to release (or hold).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleaseKey {
    /// By vGPU id (the operator's `gpuplexctl release`, the service itself).
    Vgpu(VgpuId),
    /// By the id of the container attached to it.
    Container(String),
    /// By the handle it was reserved with (what a hook or the shim undoes).
    Handle(Handle),
    /// By the uid of the ResourceClaim it was pinned for (the DRA driver's unprepare).
    Claim(String),
}

/// A released vGPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Released {
    /// Its record, as it was.
    pub record: VgpuRecord,
    /// `Some(Action::Thaw)` when its container was frozen and must be thawed.
    pub thaw: Option<Action>,
    /// What it received and waited while attached (`None`: it never was).
    pub stats: Option<VgpuStats>,
}

/// The result of [`Node::decide`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeDecision {
    /// Freeze and thaw orders, to carry out now.
    pub actions: Vec<Action>,
    /// Reservations that lapsed (no container attached within `reservation_ttl`); their memory is
    /// free again.
    pub lapsed: Vec<VgpuRecord>,
    /// When to decide again at the latest (a window's end, a work lapse, a reservation's
    /// expiry); `None`: only when something changes.
    pub next_due: Option<Instant>,
}

/// Why the node refused a request. Every message is one line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NodeError {
    /// The annotations ask for no vGPU.
    #[error("no gpuplex.io/ annotation: the container asks for no vGPU")]
    NoRequest,
    /// An annotation is invalid.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The operator's policy does not allow what the annotations ask for.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// No GPU can hold the request (the message lists every GPU's free memory).
    #[error(transparent)]
    Assign(#[from] AssignError),
    /// No such vGPU (never reserved, released, or lapsed).
    #[error("{0} is not reserved on this node (it was released, or its reservation lapsed)")]
    UnknownVgpu(VgpuId),
    /// No reservation has this handle.
    #[error("no reservation on this node has this handle (it was released, its reservation lapsed, or the handle was not gpuplex's)")]
    UnknownHandle,
    /// Every vGPU number has been given out (only a restored record with the largest number
    /// gets the node here).
    #[error("no vGPU id is left to give on this node (the highest was given); restart the node service with an empty state_dir")]
    IdsExhausted,
    /// A new reservation's handle is one the node has already (the caller's random source
    /// repeated itself).
    #[error("the handle given for a new reservation is in use already; nothing was reserved")]
    HandleInUse,
    /// No vGPU is attached to this container.
    #[error("container {0} is not attached to a vGPU on this node (it was never attached, or it was released)")]
    UnknownContainer(String),
    /// The vGPU has no container yet (a hold is a container's).
    #[error("{0} has no container attached yet: only an attached container can be held")]
    NotAttached(VgpuId),
    /// A claim's vGPU has [`MAX_SHARING`] containers already.
    #[error("{vgpu} (claim {claim}) has {MAX_SHARING} containers attached already, the most that may share a claim's vGPU")]
    SharedTooWidely {
        /// The vGPU.
        vgpu: VgpuId,
        /// Its claim.
        claim: String,
    },
    /// Its user paused one of several containers sharing a claim's vGPU.
    #[error("{vgpu} is shared by {count} containers of claim {claim}: gpuplex holds a vGPU out of its windows only when one container has it")]
    HoldShared {
        /// The vGPU.
        vgpu: VgpuId,
        /// Its claim.
        claim: String,
        /// How many containers share it.
        count: usize,
    },
    /// The vGPU is attached to another container.
    #[error("{vgpu} is attached to container {attached}, not {container}")]
    AttachedElsewhere {
        /// The vGPU.
        vgpu: VgpuId,
        /// The container it is attached to.
        attached: String,
        /// The container that asked.
        container: String,
    },
    /// The container is attached to another vGPU (or, for `register`, to this one from another
    /// cgroup).
    #[error("container {container} is already attached to {attached}")]
    ContainerAttached {
        /// The container.
        container: String,
        /// The vGPU it is attached to.
        attached: VgpuId,
    },
    /// No vGPU is pinned for this claim.
    #[error(
        "claim {0} has no vGPU on this node (it was never prepared here, or it was unprepared)"
    )]
    UnknownClaim(String),
    /// The claim has a vGPU already, placed otherwise than asked.
    #[error("claim {claim} is prepared already as {vgpu}, on other GPUs or with other memory; unprepare it first")]
    ClaimPinned {
        /// The claim's uid.
        claim: String,
        /// Its vGPU.
        vgpu: VgpuId,
    },
    /// The device plugin's units cannot make an allocation.
    #[error(transparent)]
    Units(#[from] crate::units::UnitsError),
    /// A container asked a weight or priority of a vGPU that is not an allocation's.
    #[error("{0} was given its weight and priority when it was reserved; its container cannot ask for them again")]
    NotAnAllocation(VgpuId),
    /// A container of an allocation asked for what its units decide.
    #[error("{0} is decided by the gpuplex.io/gpu-memory units the kubelet gave the container: only gpuplex.io/weight and gpuplex.io/priority may be asked for with them")]
    AskedOfAllocation(String),
    /// A claim uid that cannot name a claim.
    #[error("`{0}` is not a claim uid: it must be 1 to 128 characters without spaces or control characters, and not start with `units-`")]
    BadClaimUid(String),
    /// A pinned placement that names no GPU, a GPU twice, or no memory.
    #[error("the placement {0}")]
    BadPlacement(String),
    /// A claim's annotations name what the placement decides.
    #[error("{0} is the cluster scheduler's to choose for a claim: its config may not set it")]
    PlacedByScheduler(&'static str),
    /// A container id that cannot name a container.
    #[error(
        "`{0}` is not a container id: it must be non-empty, without spaces or control characters"
    )]
    BadContainerId(String),
    /// The window scheduler refused the vGPU (a record that does not fit this node's GPUs).
    #[error("{vgpu} cannot be scheduled: {source}")]
    Schedule {
        /// The vGPU.
        vgpu: VgpuId,
        /// Why.
        source: BindError,
    },
}

/// The node's scheduler state: inventory, windows and vGPU records.
#[derive(Clone, Debug)]
pub struct Node {
    config: SchedulerConfig,
    policy: PolicyConfig,
    inventory: Inventory,
    windows: WindowScheduler,
    records: BTreeMap<VgpuId, VgpuRecord>,
    by_container: HashMap<String, VgpuId>,
    by_handle: HashMap<Handle, VgpuId>,
    by_claim: HashMap<String, VgpuId>,
    /// Reservations no container is attached to yet, by when they were made.
    pending: BTreeSet<(Instant, VgpuId)>,
    /// Attached vGPUs that no sample has reached yet: arrivals about to start work.
    unsampled: HashSet<VgpuId>,
    next_id: u64,
    /// Who held each GPU's window when.
    events: events::EventLog,
}

impl Node {
    /// A node with these GPUs (none is allowed: every request then fails, saying so).
    pub fn new(gpus: Vec<Gpu>, config: SchedulerConfig) -> Result<Node, InventoryError> {
        let indexes: Vec<GpuIndex> = gpus.iter().map(|g| g.index).collect();
        let inventory = Inventory::new(gpus, config.memory_overcommit)?;
        Ok(Node {
            windows: WindowScheduler::new(indexes, &config),
            config,
            policy: PolicyConfig::unrestricted(),
            inventory,
            records: BTreeMap::new(),
            by_container: HashMap::new(),
            by_handle: HashMap::new(),
            by_claim: HashMap::new(),
            pending: BTreeSet::new(),
            unsampled: HashSet::new(),
            next_id: 1,
            events: events::EventLog::default(),
        })
    }

    /// The scheduler settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Bounds what a new reservation may ask for ([`PolicyConfig::admit`]); a node starts
    /// unrestricted (the simulator's), the node service sets `gpuplex.toml`'s `[policy]`.
    /// Records restored after a restart were admitted once and are not checked again.
    pub fn set_policy(&mut self, policy: PolicyConfig) {
        self.policy = policy;
    }

    /// The GPUs and the memory bound on them.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    /// The window scheduler (for views and stats).
    pub fn windows(&self) -> &WindowScheduler {
        &self.windows
    }

    /// Every vGPU, ascending by id.
    pub fn records(&self) -> impl Iterator<Item = &VgpuRecord> {
        self.records.values()
    }

    /// One vGPU.
    pub fn record(&self, vgpu: VgpuId) -> Option<&VgpuRecord> {
        self.records.get(&vgpu)
    }

    /// The vGPU a container is attached to.
    pub fn vgpu_of(&self, container: &str) -> Option<VgpuId> {
        self.by_container.get(container).copied()
    }

    /// The vGPU reserved with a handle.
    pub fn vgpu_with(&self, handle: &Handle) -> Option<VgpuId> {
        self.by_handle.get(handle).copied()
    }

    /// Numbers the vGPUs reserved from now on from `first` up, unless higher numbers were given
    /// out already. The node service starts ids above every id it gave out before (it saves the
    /// next one) and above a clock reading, so that an id is never given twice on a node, even
    /// after its state was lost: a container that still runs with a vGPU's identity never sees
    /// that id named on another container.
    pub fn start_ids_at(&mut self, first: u64) {
        self.next_id = self.next_id.max(first);
    }

    /// The number the next vGPU will get.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    /// Reserves a vGPU for a container that does not exist yet; its container attaches with
    /// `handle` (fresh and random: the caller's).
    pub fn reserve<'a>(
        &mut self,
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
        handle: Handle,
        now: Instant,
    ) -> Result<&VgpuRecord, NodeError> {
        if self.by_handle.contains_key(&handle) {
            return Err(NodeError::HandleInUse);
        }
        let annotations: BTreeMap<String, String> = annotations
            .into_iter()
            .filter(|(k, _)| k.starts_with(crate::request::PREFIX) || is_pod_key(k))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let request = self.admitted(&annotations)?;
        let id = VgpuId(self.next_id);
        // Spent even when the reservation is refused: the refusal names it, and an id that was
        // ever shown is never another vGPU's.
        self.next_id = self.next_id.checked_add(1).ok_or(NodeError::IdsExhausted)?;
        // A GPU counts as having work when a vGPU there has work, or when an arrival there is
        // about to start (a reservation waiting for its container, or a container no sample has
        // reached yet), so that arrivals close together get different idle GPUs where there are
        // enough, under either policy.
        let records = &self.records;
        let arriving = self
            .pending
            .iter()
            .map(|&(_, v)| v)
            .chain(self.unsampled.iter().copied());
        let arriving: Vec<GpuIndex> = arriving
            .flat_map(|v| records[&v].assignment.gpus.iter().copied())
            .collect();
        let windows = &self.windows;
        let has_work = |g: GpuIndex| windows.gpu_has_work(g) || arriving.contains(&g);
        let assignment = self
            .inventory
            .assign(id, &request, self.config.policy, has_work)?;
        self.pending.insert((now, id));
        self.by_handle.insert(handle, id);
        let record = VgpuRecord {
            id,
            handle,
            annotations,
            request,
            assignment,
            reserved_at: now,
            attachments: Vec::new(),
            claim: None,
            units: Vec::new(),
        };
        Ok(self.records.entry(id).or_insert(record))
    }

    /// Attaches a container to the reservation made with `handle` and starts scheduling it.
    /// Attaching the same container again returns the same record. A claim's vGPU takes more
    /// containers (its pod's, up to [`MAX_SHARING`]): they share it and its windows; any other
    /// vGPU has one.
    pub fn attach(
        &mut self,
        handle: &Handle,
        attachment: Attachment,
        now: Instant,
    ) -> Result<&VgpuRecord, NodeError> {
        let vgpu = self.vgpu_with(handle).ok_or(NodeError::UnknownHandle)?;
        self.attach_vgpu(vgpu, attachment, now)
    }

    fn attach_vgpu(
        &mut self,
        vgpu: VgpuId,
        attachment: Attachment,
        now: Instant,
    ) -> Result<&VgpuRecord, NodeError> {
        check_container_id(&attachment.container)?;
        let record = self
            .records
            .get(&vgpu)
            .ok_or(NodeError::UnknownVgpu(vgpu))?;
        if record.containers().any(|c| c == attachment.container) {
            return Ok(&self.records[&vgpu]);
        }
        match (&record.claim, record.attachment()) {
            (None, Some(a)) => {
                return Err(NodeError::AttachedElsewhere {
                    vgpu,
                    attached: a.container.clone(),
                    container: attachment.container,
                })
            }
            (Some(claim), _) if record.attachments.len() >= MAX_SHARING => {
                return Err(NodeError::SharedTooWidely {
                    vgpu,
                    claim: claim.clone(),
                })
            }
            _ => {}
        }
        if let Some(&attached) = self.by_container.get(&attachment.container) {
            return Err(NodeError::ContainerAttached {
                container: attachment.container,
                attached,
            });
        }
        if record.attachments.is_empty() {
            let binding = Binding {
                gpus: record.assignment.gpus.clone(),
                weight: record.request.weight,
                priority: record.request.priority,
            };
            self.windows
                .bind(vgpu, binding, now)
                .map_err(|source| NodeError::Schedule { vgpu, source })?;
            self.unsampled.insert(vgpu);
            self.pending.remove(&(record.reserved_at, vgpu));
        }
        self.by_container.insert(attachment.container.clone(), vgpu);
        let record = self.records.get_mut(&vgpu).expect("checked above");
        record.attachments.push(attachment);
        Ok(record)
    }

    /// Reserves and attaches at once (`handle` as for [`Node::reserve`]). A container that is
    /// already attached, with the same target, gets its vGPU again (a hook that runs twice);
    /// the same container id with another target is refused, so that a container cannot get
    /// another's vGPU by taking its id. On any error nothing is left reserved.
    pub fn register<'a>(
        &mut self,
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
        handle: Handle,
        attachment: Attachment,
        now: Instant,
    ) -> Result<&VgpuRecord, NodeError> {
        check_container_id(&attachment.container)?;
        if let Some(&vgpu) = self.by_container.get(&attachment.container) {
            let record = &self.records[&vgpu];
            if record.attachments.contains(&attachment) {
                return Ok(record);
            }
            return Err(NodeError::ContainerAttached {
                container: attachment.container,
                attached: vgpu,
            });
        }
        let vgpu = self.reserve(annotations, handle, now)?.id;
        match self.attach_vgpu(vgpu, attachment, now) {
            Ok(_) => Ok(&self.records[&vgpu]),
            Err(e) => {
                self.release(&ReleaseKey::Vgpu(vgpu), now);
                Err(e)
            }
        }
    }

    /// Releases a vGPU (by its id, its container's, its handle or its claim); `None` when there
    /// is none. A claim's vGPU is its claim's: only its claim or its id releases it, never one
    /// of its containers or its handle (see [`Node::detach`] for a container that goes).
    pub fn release(&mut self, key: &ReleaseKey, now: Instant) -> Option<Released> {
        let vgpu = match key {
            ReleaseKey::Vgpu(v) => *v,
            ReleaseKey::Container(c) => *self.by_container.get(c)?,
            ReleaseKey::Handle(h) => *self.by_handle.get(h)?,
            ReleaseKey::Claim(c) => *self.by_claim.get(c)?,
        };
        let by_its_user = matches!(key, ReleaseKey::Container(_) | ReleaseKey::Handle(_));
        if by_its_user && self.records.get(&vgpu)?.claim.is_some() {
            return None;
        }
        let record = self.records.remove(&vgpu)?;
        for container in record.containers() {
            self.by_container.remove(container);
        }
        if let Some(claim) = &record.claim {
            self.by_claim.remove(claim);
        }
        self.by_handle.remove(&record.handle);
        self.unsampled.remove(&vgpu);
        self.pending.remove(&(record.reserved_at, vgpu));
        let unbound = self.windows.unbind(vgpu, now);
        self.inventory.release(vgpu);
        Some(Released {
            record,
            thaw: unbound.as_ref().and_then(|u| u.thaw),
            stats: unbound.map(|u| u.stats),
        })
    }

    /// Holds an attached vGPU's container (`held`: its user paused it) or releases the hold
    /// (its user resumed it), by vGPU id or container id; see [`WindowScheduler::hold`].
    /// Idempotent. Refused for an unknown vGPU or container, a reservation with no container,
    /// and a hold of a claim's vGPU that several containers share (pausing one of them cannot
    /// take the vGPU out of the windows the others take).
    pub fn hold(
        &mut self,
        key: &ReleaseKey,
        held: bool,
        now: Instant,
    ) -> Result<VgpuId, NodeError> {
        let vgpu = self.holdable(key, held)?;
        self.windows.hold(vgpu, held, now);
        if held {
            self.unsampled.remove(&vgpu);
        }
        Ok(vgpu)
    }

    /// The vGPU [`Node::hold`] would hold (or let go of), or why it refuses: what a caller
    /// checks before it saves the hold.
    pub fn holdable(&self, key: &ReleaseKey, held: bool) -> Result<VgpuId, NodeError> {
        let vgpu = self.attached(key)?;
        let record = &self.records[&vgpu];
        if held && record.attachments.len() > 1 && !self.windows.is_held(vgpu) {
            return Err(NodeError::HoldShared {
                vgpu,
                claim: record.claim.clone().unwrap_or_default(),
                count: record.attachments.len(),
            });
        }
        Ok(vgpu)
    }

    /// The attached vGPU `key` names (what [`Node::hold`] accepts), or why there is none.
    pub fn attached(&self, key: &ReleaseKey) -> Result<VgpuId, NodeError> {
        let vgpu = match key {
            ReleaseKey::Vgpu(v) => *v,
            ReleaseKey::Container(c) => *self
                .by_container
                .get(c)
                .ok_or_else(|| NodeError::UnknownContainer(c.clone()))?,
            ReleaseKey::Handle(h) => *self.by_handle.get(h).ok_or(NodeError::UnknownHandle)?,
            ReleaseKey::Claim(c) => *self
                .by_claim
                .get(c)
                .ok_or_else(|| NodeError::UnknownClaim(c.clone()))?,
        };
        let record = self
            .records
            .get(&vgpu)
            .ok_or(NodeError::UnknownVgpu(vgpu))?;
        if record.attachments.is_empty() {
            return Err(NodeError::NotAttached(vgpu));
        }
        Ok(vgpu)
    }

    /// Says that an attached vGPU's container has a stop signal pending (see
    /// [`WindowScheduler::stop`]): the thaw order to carry out, if it was frozen.
    pub fn stopping(
        &mut self,
        vgpu: VgpuId,
        signal: crate::windows::StopSignal,
        now: Instant,
    ) -> Option<Action> {
        self.unsampled.remove(&vgpu);
        self.windows.stop(vgpu, signal, now)
    }

    /// Whether a vGPU's container is held ([`Node::hold`]).
    pub fn is_held(&self, vgpu: VgpuId) -> bool {
        self.windows.is_held(vgpu)
    }

    /// Records an activity sample of an attached vGPU (see [`WindowScheduler::observe`]).
    pub fn observe(&mut self, vgpu: VgpuId, has_work: bool, now: Instant) -> bool {
        if !self.unsampled.is_empty() {
            self.unsampled.remove(&vgpu);
        }
        self.windows.observe(vgpu, has_work, now)
    }

    /// Records a sample that cannot tell yet (see [`WindowScheduler::observe_unseen`]).
    pub fn observe_unseen(&mut self, vgpu: VgpuId, now: Instant) -> bool {
        self.windows.observe_unseen(vgpu, now)
    }

    /// Decides who runs now, and lets lapsed reservations go.
    pub fn decide(&mut self, now: Instant) -> NodeDecision {
        let ttl = self.config.reservation_ttl;
        let mut lapsed = Vec::new();
        while let Some(&(reserved_at, vgpu)) = self.pending.first() {
            if now < reserved_at + ttl {
                break;
            }
            self.pending.pop_first();
            lapsed.extend(self.release(&ReleaseKey::Vgpu(vgpu), now).map(|r| r.record));
        }
        let Decision { actions, next_due } = self.windows.decide(now);
        for (gpu, holder) in self.windows.holders() {
            let records = &self.records;
            let container = || {
                let record = records.get(&holder?)?;
                Some(record.attachment()?.container.clone())
            };
            self.events.holder(gpu, holder, container, now);
        }
        let next_lapse = self.pending.first().map(|&(at, _)| at + ttl);
        NodeDecision {
            actions,
            lapsed,
            next_due: [next_due, next_lapse].into_iter().flatten().min(),
        }
    }

    /// The window events numbered above `since`, and the number of the oldest kept.
    pub fn events(&self, since: u64) -> (Vec<events::WindowEvent>, u64) {
        self.events.since(since)
    }

    /// Binds a record again after a restart (from the service's persisted state): its memory
    /// is reserved as assigned, never beyond a GPU's capacity × overcommit, and an attached one
    /// is scheduled again. Refused when it does not fit; then nothing changes.
    pub fn restore(&mut self, record: VgpuRecord, now: Instant) -> Result<(), NodeError> {
        let vgpu = record.id;
        if self.records.contains_key(&vgpu) {
            return Err(NodeError::Assign(AssignError::AlreadyAssigned {
                vgpu,
                gpus: self.records[&vgpu].assignment.gpus.clone(),
            }));
        }
        if self.by_handle.contains_key(&record.handle) {
            return Err(NodeError::HandleInUse);
        }
        if let Some(claim) = &record.claim {
            check_claim_uid(claim)?;
            if let Some(&pinned) = self.by_claim.get(claim) {
                return Err(NodeError::ClaimPinned {
                    claim: claim.clone(),
                    vgpu: pinned,
                });
            }
        }
        if record.attachments.len() > 1 && record.claim.is_none() {
            return Err(NodeError::AttachedElsewhere {
                vgpu,
                attached: record.attachments[0].container.clone(),
                container: record.attachments[1].container.clone(),
            });
        }
        for (i, a) in record.attachments.iter().enumerate() {
            check_container_id(&a.container)?;
            let twice = record.attachments[..i]
                .iter()
                .any(|b| b.container == a.container);
            let attached = match self.by_container.get(&a.container) {
                Some(&other) => Some(other),
                None => twice.then_some(vgpu),
            };
            if let Some(attached) = attached {
                return Err(NodeError::ContainerAttached {
                    container: a.container.clone(),
                    attached,
                });
            }
        }
        self.inventory.restore(record.assignment.clone())?;
        if !record.attachments.is_empty() {
            let binding = Binding {
                gpus: record.assignment.gpus.clone(),
                weight: record.request.weight,
                priority: record.request.priority,
            };
            if let Err(source) = self.windows.bind(vgpu, binding, now) {
                self.inventory.release(vgpu);
                return Err(NodeError::Schedule { vgpu, source });
            }
            for a in &record.attachments {
                self.by_container.insert(a.container.clone(), vgpu);
            }
        } else if record.claim.is_none() {
            self.pending.insert((record.reserved_at, vgpu));
        }
        self.next_id = self.next_id.max(vgpu.0.saturating_add(1));
        self.by_handle.insert(record.handle, vgpu);
        if let Some(claim) = &record.claim {
            self.by_claim.insert(claim.clone(), vgpu);
        }
        self.records.insert(vgpu, record);
        Ok(())
    }
}

impl Node {
    /// Carries a vGPU's accounting over a restart (see [`WindowScheduler::carry_over_vgpu_stats`]).
    pub fn carry_over_vgpu_stats(&mut self, vgpu: VgpuId, stats: VgpuStats) -> bool {
        self.windows.carry_over_vgpu_stats(vgpu, stats)
    }

    /// Carries a GPU's accounting over a restart.
    pub fn carry_over_gpu_stats(&mut self, gpu: GpuIndex, stats: GpuStats) -> bool {
        self.windows.carry_over_gpu_stats(gpu, stats)
    }
}

impl Node {
    /// The request kept annotations make (`gpuplex.io/` keys and the pod's), as the operator's
    /// policy admits it for the pod's namespace: the one check of every reservation, pin and
    /// allocation's weight.
    fn admitted(&self, annotations: &BTreeMap<String, String>) -> Result<VgpuRequest, NodeError> {
        let request = VgpuRequest::from_annotations(
            annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        )?
        .ok_or(NodeError::NoRequest)?;
        let namespace = crate::request::POD_NAMESPACE_KEYS
            .iter()
            .find_map(|key| annotations.get(*key));
        self.policy.admit(&request, namespace.map(String::as_str))?;
        Ok(request)
    }
}

fn is_pod_key(key: &str) -> bool {
    use crate::request::{POD_NAMESPACE_KEYS, POD_NAME_KEYS};
    POD_NAME_KEYS.contains(&key) || POD_NAMESPACE_KEYS.contains(&key)
}

fn check_claim_uid(uid: &str) -> Result<(), NodeError> {
    if uid.is_empty() || uid.len() > 128 || uid.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(NodeError::BadClaimUid(uid.to_string()));
    }
    Ok(())
}

fn check_container_id(id: &str) -> Result<(), NodeError> {
    if id.is_empty() || id.len() > 1024 || id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(NodeError::BadContainerId(id.to_string()));
    }
    Ok(())
}

mod allocated;
pub mod events;
mod pinned;
mod status;
pub use allocated::{allocation_key, Allocated, ALLOCATION_PREFIX};
pub use pinned::Placement;
pub use status::{ContainerState, ContainerStatus, GpuStatus, NodeStatus, ReservationStatus};

#[cfg(test)]
mod tests;
