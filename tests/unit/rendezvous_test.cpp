#include "difftrain/distributed/rendezvous.h"
#include "difftrain/core/error.h"
#include "difftrain/distributed/net.h"

#include <gtest/gtest.h>

#include <map>

namespace difftrain::distributed {
namespace {

EnvLookup fake(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(Rendezvous, NoVariablesIsAWorldOfOne) {
  const auto info = detect_rendezvous(fake({}));
  EXPECT_EQ(info.source, RendezvousSource::kNone);
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_world_size, 1);
  EXPECT_TRUE(info.is_main_process());
}

TEST(Rendezvous, TorchrunContract) {
  const auto info = detect_rendezvous(fake({{"RANK", "5"},
                                            {"WORLD_SIZE", "8"},
                                            {"LOCAL_RANK", "1"},
                                            {"LOCAL_WORLD_SIZE", "4"},
                                            {"GROUP_RANK", "1"},
                                            {"MASTER_ADDR", "10.1.2.3"},
                                            {"MASTER_PORT", "1234"},
                                            {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_EQ(info.source, RendezvousSource::kTorchrun);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 1234);
  EXPECT_EQ(info.restart_count, 2);
  EXPECT_EQ(info.store_description(), "10.1.2.3:1234");
  EXPECT_FALSE(info.store_hosted);
}

TEST(Rendezvous, NodeRankAndDefaults) {
  const auto info = detect_rendezvous(
      fake({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"NODE_RANK", "3"}, {"MASTER_ADDR", "h"}}));
  EXPECT_EQ(info.node_rank, 3);
  EXPECT_EQ(info.master_port, 29500);
  EXPECT_EQ(info.local_rank, 1);  // LOCAL_RANK defaults to RANK
}

TEST(Rendezvous, DifftrainLauncherVariables) {
  const auto info = detect_rendezvous(fake({{"RANK", "0"},
                                            {"WORLD_SIZE", "2"},
                                            {"DIFFTRAIN_STORE_FILE", "/tmp/x/store.gen1"},
                                            {"DIFFTRAIN_RESTART_COUNT", "1"}}));
  EXPECT_EQ(info.store_file, "/tmp/x/store.gen1");
  EXPECT_EQ(info.restart_count, 1);
  EXPECT_EQ(info.store_description(), "file /tmp/x/store.gen1");
  const auto hosted = detect_rendezvous(fake(
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"DIFFTRAIN_STORE_HOSTED", "1"}}));
  EXPECT_TRUE(hosted.store_hosted);
  // torchrun's elastic agent serves the store itself.
  const auto agent = detect_rendezvous(fake({{"RANK", "0"},
                                             {"WORLD_SIZE", "2"},
                                             {"MASTER_ADDR", "h"},
                                             {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_TRUE(agent.store_hosted);
}

TEST(Rendezvous, OpenMpi) {
  const auto info = detect_rendezvous(fake({{"OMPI_COMM_WORLD_RANK", "3"},
                                            {"OMPI_COMM_WORLD_SIZE", "4"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                            {"MASTER_ADDR", "m"}}));
  EXPECT_EQ(info.source, RendezvousSource::kOpenMpi);
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.node_rank, 1);
}

TEST(Rendezvous, OpenMpiWithoutMasterAddrSaysWhatToSet) {
  try {
    detect_rendezvous(fake({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("openmpi"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, SlurmTakesFirstHostOfNodelist) {
  const auto info = detect_rendezvous(fake({{"SLURM_PROCID", "5"},
                                            {"SLURM_NTASKS", "6"},
                                            {"SLURM_LOCALID", "2"},
                                            {"SLURM_NTASKS_PER_NODE", "3"},
                                            {"SLURM_NODEID", "1"},
                                            {"SLURM_NODELIST", "gpu[07-09,12]"}}));
  EXPECT_EQ(info.source, RendezvousSource::kSlurm);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 6);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 3);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.master_addr, "gpu07");
  // MASTER_ADDR, when set, wins.
  const auto set = detect_rendezvous(fake({{"SLURM_PROCID", "0"},
                                           {"SLURM_NTASKS", "2"},
                                           {"SLURM_TASKS_PER_NODE", "2(x1)"},
                                           {"SLURM_NODELIST", "a[1-2]"},
                                           {"MASTER_ADDR", "head"}}));
  EXPECT_EQ(set.master_addr, "head");
  EXPECT_EQ(set.local_world_size, 2);
}

TEST(Rendezvous, SlurmNodelistForms) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("n[3-5]"), "n3");
  EXPECT_EQ(first_slurm_host("n[03,07-09],m1"), "n03");
}

TEST(Rendezvous, TorchrunWinsOverSlurm) {
  const auto info = detect_rendezvous(fake({{"RANK", "1"},
                                            {"WORLD_SIZE", "2"},
                                            {"MASTER_ADDR", "x"},
                                            {"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "1"}}));
  EXPECT_EQ(info.source, RendezvousSource::kTorchrun);
  EXPECT_EQ(info.rank, 1);
}

TEST(Rendezvous, BadValuesNameTheVariable) {
  auto message = [](std::map<std::string, std::string> vars) {
    try {
      detect_rendezvous(fake(vars));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x'"), std::string::npos);
  EXPECT_NE(message({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}})
                .find("not below the world size"),
            std::string::npos);
  EXPECT_NE(message({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).find("needs MASTER_ADDR"),
            std::string::npos);
  EXPECT_NE(
      message({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}})
          .find("MASTER_PORT=70000"),
      std::string::npos);
  EXPECT_NE(message({{"RANK", "0"}, {"WORLD_SIZE", "-1"}}).find("WORLD_SIZE='-1'"),
            std::string::npos);
}

TEST(Net, LoopbackAndRoutes) {
  EXPECT_TRUE(is_loopback_host("localhost"));
  EXPECT_TRUE(is_loopback_host("127.0.0.1"));
  EXPECT_TRUE(is_loopback_host("127.3.4.5"));
  EXPECT_FALSE(is_loopback_host("10.0.0.1"));
  EXPECT_EQ(local_address_towards("127.0.0.1", 29500), "127.0.0.1");
  EXPECT_EQ(resolve_host("127.0.0.1"), "127.0.0.1");
  EXPECT_THROW(resolve_host("no-such-host.invalid"), Error);
  const int port = find_free_port();
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
}

}  // namespace
}  // namespace difftrain::distributed
